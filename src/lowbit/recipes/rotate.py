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
from lowbit.recipes.base import QuantizeContext, Recipe
from lowbit.recipes.registry import register
from lowbit.transforms.rotate import rotate_model


@register
@dataclass
class RotateRecipe(Recipe):
    """Rotate the model (seed 000's transform); quantizes nothing.

    Settings:
        rotation: hadamard (randomized) or random (random orthogonal).
        seed: seed of the rotation's random signs or matrix.
        online_fp16: compute the online Hadamards in fp16 instead of fp32.
    """

    method = "rotate"

    rotation: Literal["hadamard", "random"] = "hadamard"
    seed: int = 0
    online_fp16: bool = False

    def validate(self) -> None:
        if self.rotation not in ("hadamard", "random"):
            raise LowbitError(f"rotation must be hadamard or random, not {self.rotation!r}")

    def apply(self, model, context: QuantizeContext) -> None:
        rotate_model(
            model,
            rotation=self.rotation,
            seed=self.seed,
            online_dtype=torch.float16 if self.online_fp16 else torch.float32,
        )
