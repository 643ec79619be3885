"""The ``rotate`` recipe: QuaRot's function-preserving rotation alone, to compose with others.

``rotate+gptq``, ``rotate+spqr+kvquant``: the rotation (norm fusion, untied embeddings, the
residual stream rotated by a seeded randomized Hadamard or random orthogonal matrix, online
Hadamards before down_proj and o_proj) leaves every linear in float, and the weight recipe
that follows keeps each linear's online transform (:mod:`lowbit.algorithms.weights`). ``quarot``
is this rotation plus its own integer weights, activations and KV cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from lowbit.errors import LowbitError
from lowbit.recipes.base import QuantizeContext, Recipe, check_seed
from lowbit.recipes.registry import register
from lowbit.settings import Count
from lowbit.transforms.rotate import rotate_model


@register
@dataclass
class RotateRecipe(Recipe):
    """Rotate the model (QuaRot's transform); quantizes nothing.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "rotate"
    roles = frozenset({"rotation"})
    paper = "QuaRot's rotation (Ashkboos et al., 2024)"

    rotation: Literal["hadamard", "random"] = "hadamard"
    seed: Count = 0
    online_fp16: bool = False
    online: bool = True
    hadamard_block: int | None = None

    def validate(self) -> None:
        if self.rotation not in ("hadamard", "random"):
            raise LowbitError(f"rotation must be hadamard or random, not {self.rotation!r}")
        check_seed("seed", self.seed)

    def apply(self, model, context: QuantizeContext) -> None:
        rotate_model(
            model,
            rotation=self.rotation,
            seed=self.seed,
            online_dtype=torch.float16 if self.online_fp16 else torch.float32,
            online=self.online,
            hadamard_block=self.hadamard_block,
        )
        context.transformed(model)
