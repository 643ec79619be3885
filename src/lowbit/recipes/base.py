"""The recipe base class: one versioned, JSON-serialisable config dataclass per method.

A recipe is data. ``to_dict()`` goes into checkpoints and ``--json`` reports; ``from_dict()``
rebuilds it; ``with_settings()`` applies ``--set key=value`` overrides with the field's type.
``apply()`` runs the method on a model in place; it is the only part that does work.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, ClassVar

import torch

from lowbit.errors import LowbitError
from lowbit.settings import check_fields, field_annotations, parse_text

OFF_BITS = 16  # a bit width of 16 means "not quantized" throughout lowbit

#: What a recipe can do to a model, in the order a composition must do it, each with what the
#: role does and why one part plays it at most once. A rotation changes the weights every later
#: part quantizes; a weight recipe replaces every selected linear (its weight and the slot of its
#: activation quantizer), so a second one would quantize weights that are no longer float; the KV
#: cache is calibrated on, and installed into, the model the earlier parts made.
ROLES: dict[str, tuple[str, str]] = {
    "rotation": ("rotates the model", "a model is rotated once"),
    "weights": ("quantizes the weights", "the second would find no float weight to quantize"),
    "activations": ("quantizes the activations", "a linear has one activation quantizer"),
    "kv": ("quantizes the KV cache", "a model holds one KV cache"),
}


def check_bits(name: str, bits: int, *, allow_off: bool = True) -> None:
    """Bits must be 2-8 (or 16 for off where allowed)."""
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise LowbitError(f"{name} must be an integer, not {bits!r}")
    if 2 <= bits <= 8 or (allow_off and bits == OFF_BITS):
        return
    off = " or 16 for off" if allow_off else ""
    raise LowbitError(f"{name} must be between 2 and 8{off}, not {bits}")


def check_seed(name: str, seed: int) -> None:
    """A seed must be an integer torch's generators take (0 to 2**64 - 1)."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**64:
        raise LowbitError(f"{name} must be an integer from 0 to 2**64 - 1, not {seed!r}")


#: the widest bit width at which an unset clip ratio takes the paper's value (QuaRot clips at
#: 4 bits). Wider streams are not clipped: at 6 and 8 bits the clip cost accuracy on the
#: embedded model (docs/results/quarot.md, the clip ablation).
CLIP_MAX_BITS = 4


def resolve_clip(ratio: float | None, bits: int, paper_ratio: float) -> float:
    """``ratio`` when set; unset (None): ``paper_ratio`` up to :data:`CLIP_MAX_BITS`, else 1."""
    if ratio is not None:
        return ratio
    return paper_ratio if bits <= CLIP_MAX_BITS else 1.0


def check_clip(name: str, ratio: float | None) -> None:
    if ratio is not None and not 0.0 < ratio <= 1.0:
        raise LowbitError(f"{name} must be in (0, 1] or none, not {ratio}")


def check_group(name: str, group: int | None) -> None:
    if group is not None and (isinstance(group, bool) or not isinstance(group, int) or group < 1):
        raise LowbitError(f"{name} must be a positive integer or none, not {group!r}")


def check_gptq_settings(recipe: Any) -> None:
    """A GPTQ recipe's settings (``lowbit.recipes.linear_settings.GPTQRecipeSettings``) in
    range, one sentence each: building its ``GPTQSettings`` checks them."""
    recipe.gptq_settings()


def check_kv_fits(adapter: Any, quantizers: list) -> None:
    """Raise LowbitError when a KV quantizer (None = a stream left in float) cannot serve the
    model's heads: what installing the cache would find, checked before the parts of a
    composition that come first do their work."""
    for quantizer in quantizers:
        if quantizer is not None:
            quantizer.check(adapter.head_dim)


def refuse_global_overrides(
    method: str, overrides: dict[str, dict], names: tuple[str, ...]
) -> None:
    """Refuse per-layer overrides of the settings ``names`` that apply to a whole run."""
    for values in overrides.values():
        fixed = sorted(set(values) & set(names))
        if fixed:
            raise LowbitError(
                f"{method} settings {', '.join(fixed)} apply to the whole model and cannot be "
                "overridden per layer"
            )


@dataclasses.dataclass
class Recipe:
    """Base of every method's config. Subclasses are dataclasses registered by name."""

    method: ClassVar[str] = ""
    version: ClassVar[int] = 1
    needs_calibration: ClassVar[bool] = False
    #: the :data:`ROLES` the method plays (``fp``: none; ``quarot``: all of its parts' roles)
    roles: ClassVar[frozenset[str]] = frozenset()
    #: the paper the method comes from, "Name (Author et al., year)"; empty for none
    paper: ClassVar[str] = ""
    #: whether ``apply`` works block by block through ``QuantizeContext.blocks`` (the streamed
    #: quantizer, :mod:`lowbit.io.stream`): a method that needs the whole model at once (a
    #: residual rotation, training through every block, a KV cache calibrated end to end) does not
    streams: ClassVar[bool] = False
    #: whether ``apply`` can share its calibration between processes through
    #: ``QuantizeContext.group`` (:mod:`lowbit.calibrate.distributed`)
    distributes: ClassVar[bool] = False

    # -- validation and (de)serialisation -----------------------------------------------------
    def validate(self) -> None:
        """Raise LowbitError when a setting is out of range. Subclasses extend it.

        These are the checks a single layer's settings pass too (a per-layer override may
        leave a layer alone, e.g. ``w_bits=16``); :meth:`check_does_something` is the check of
        a whole model's recipe."""

    def played_roles(self) -> frozenset[str]:
        """The roles these settings play: :attr:`roles`, less those a setting turns off
        (``quarot`` with ``rotation=none`` rotates nothing, so a ``rotate`` part may)."""
        return self.roles

    def nothing_to_do(self) -> str | None:
        """Why these settings leave the recipe nothing to do on a whole model (the end of the
        sentence "recipe ... does nothing: ..."), or None when they do something. Subclasses
        whose settings can turn every step off say so here."""
        return None

    def check_does_something(self) -> None:
        """Raise LowbitError when the recipe, applied to a whole model, would change nothing
        (``rtn`` with ``w_bits=16 a_bits=16`` would write the float model as a "quantized" one;
        ``fp`` is the way to ask for that)."""
        reason = self.nothing_to_do()
        if reason is not None:
            raise LowbitError(f"recipe {self.method!r} with these settings does nothing: {reason}")

    def check_model(self, model: torch.nn.Module, context: QuantizeContext) -> None:
        """Raise LowbitError when the recipe cannot apply to ``model`` (a group that does not
        divide a width): cheap checks that a composition runs for every part before its first
        part does any work. Subclasses whose failure would otherwise come late extend it."""

    def settings(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def to_dict(self) -> dict[str, Any]:
        return {"method": self.method, "version": self.version, "settings": self.settings()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Recipe:
        if data.get("method") != cls.method:
            raise LowbitError(f"recipe data is for {data.get('method')!r}, not {cls.method!r}")
        if data.get("version") != cls.version:
            raise LowbitError(
                f"recipe {cls.method!r} version {data.get('version')} cannot be read by this "
                f"lowbit (it reads version {cls.version})"
            )
        settings = data.get("settings", {})
        fields = cls.field_types()
        check_fields(settings, fields, f"{cls.method} recipe", optional=tuple(fields))
        recipe = cls(**settings)
        recipe.validate()
        return recipe

    @classmethod
    def field_types(cls) -> dict[str, Any]:
        """Each setting's annotation (:mod:`lowbit.settings` reads and checks values by it)."""
        return field_annotations(cls)

    def with_settings(self, **values: Any) -> Recipe:
        """A copy with some settings changed, as a whole model's recipe; string values are read
        with the field's type. Settings out of range, or that leave the recipe nothing to do,
        are a LowbitError."""
        recipe = self.for_layer(**values)
        recipe.check_does_something()
        return recipe

    def for_layer(self, **values: Any) -> Recipe:
        """A copy with some settings changed, as a per-layer override makes it: settings out
        of range are a LowbitError, and a layer may be left alone (``w_bits=16``)."""
        types_by_name = self.field_types()
        changes = {}
        for key, value in values.items():
            if key not in types_by_name:
                raise LowbitError(
                    f"recipe {self.method!r} has no setting {key!r}; its settings are: "
                    f"{', '.join(types_by_name)}"
                )
            try:
                changes[key] = parse_text(value, types_by_name[key])
                if isinstance(changes[key], float) and not math.isfinite(changes[key]):
                    raise ValueError(f"{changes[key]} is not a finite number")  # from the API
            except ValueError as err:
                raise LowbitError(
                    f"setting {key}={value!r} of recipe {self.method!r}: {err}"
                ) from err
        recipe = dataclasses.replace(self, **changes)
        recipe.validate()
        return recipe

    # -- work ---------------------------------------------------------------------------------
    def apply(
        self, model: torch.nn.Module, context: QuantizeContext
    ) -> dict[str, dict[str, Any]] | None:
        """Quantize ``model`` in place. Returns None, or settings this method learned for the
        parts after it in a composition, per layer (``{layer name: {setting: value}}``, e.g.
        a learned rotation's activation clips), which they apply before the user's
        overrides."""
        raise NotImplementedError

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        """Bytes the KV cache stores per token at ``context_length``; None means unquantized."""
        return None


@dataclasses.dataclass
class QuantizeContext:
    """What ``Recipe.apply`` gets besides the model.

    Attributes:
        adapter: the model's adapter (the only thing that knows layer names).
        calibration: [n_samples, seqlen] token ids, or None.
        includes: ``includes(module, fqn)`` (``lowbit.quantize``'s ``filter_fn``) says whether
            a linear is quantized; None = all.
        overrides: per-layer settings, ``{fnmatch pattern: {setting: value}}``, applied in order.
        progress: show progress bars.
        resume_dir: directory of block checkpoints for methods that calibrate weights with
            GPTQ (:mod:`lowbit.calibrate.resume`), or None.
        device: compute device of calibration, or None for where the model's blocks are
            (:meth:`compute_device`).
        on_transformed: called with the model by a recipe that changes the model's bases
            (a rotation) once that function-preserving transform is done and before anything
            is quantized: the float reference in those bases (:mod:`lowbit.eval.layer_error`).
        blocks: the :class:`~lowbit.calibrate.capture.BlockHooks` of a streamed model (its
            blocks are read when their turn comes and written when done), handed to the weight
            driver by recipes that :attr:`~Recipe.streams`; None: the model is in memory.
        group: the :class:`~lowbit.calibrate.distributed.Group` of processes sharing the
            calibration, for recipes that :attr:`~Recipe.distributes`; None: one process.
    """

    adapter: Any
    calibration: torch.Tensor | None = None
    includes: Any = None
    overrides: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)
    progress: bool = True
    resume_dir: str | Path | None = None
    device: torch.device | None = None
    on_transformed: Any = None
    blocks: Any = None
    group: Any = None

    def transformed(self, model: torch.nn.Module) -> None:
        """Say that ``model``'s function-preserving transforms are done (see
        :attr:`on_transformed`)."""
        if self.on_transformed is not None:
            self.on_transformed(model)

    def compute_device(self) -> torch.device:
        """Where calibration computes: :attr:`device`, else where the first block's parameters
        are."""
        if self.device is not None:
            return torch.device(self.device)
        return next(self.adapter.blocks_module.parameters()).device

    def selected(self, module: torch.nn.Module, fqn: str) -> bool:
        """Whether the linear ``fqn`` is quantized (arguments in ``filter_fn``'s order)."""
        return self.includes is None or bool(self.includes(module, fqn))

    def resume_fingerprint(self, recipe: Recipe) -> dict[str, Any]:
        """The recipe and overrides, as a resume directory records them."""
        return {"recipe": recipe.to_dict(), "overrides": self.overrides}

    def recipe_for(self, recipe: Recipe, fqn: str) -> Recipe:
        """``recipe`` with the overrides whose pattern matches ``fqn`` applied."""
        from fnmatch import fnmatchcase

        for pattern, values in self.overrides.items():
            if fnmatchcase(fqn, pattern):
                recipe = recipe.for_layer(**values)
        return recipe
