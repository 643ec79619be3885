"""The ``spqr`` recipe: SpQR weights (Dettmers et al., 2024), calibrated layer by layer.

Each block linear is quantized by :func:`~lowbit.algorithms.spqr.spqr_quantize` on the Hessian
of its inputs (the shared driver, :func:`lowbit.algorithms.weights.quantize_linears`): 3-bit
codes in 16 x 16 tiles with 3-bit first-order statistics and fp16 second-order ones, plus up to
``outlier_fraction`` of the weights as fp16 outliers. Simulated like ``gptq`` (each weight holds
its dequantized values, its packed storage is counted exactly); ``lowbit.quantize(...,
packed=True)`` and ``lowbit quantize`` pack it into :class:`~lowbit.nn.spqr_linear.SpQRLinear`
(the 64-bit words of Crnčević's SpQR inference kernel, master's thesis, 2025), which needs the
packed layout's format (3 bits, beta 16/16, 3-bit statistics). Rotation and KV caches come
from composition: ``rotate+spqr+kvquant``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from lowbit.algorithms.spqr import MAX_OUTLIER_FRACTION, SpQRSpec
from lowbit.algorithms.weights import quantize_linears
from lowbit.errors import LowbitError
from lowbit.recipes.base import (
    QuantizeContext,
    Recipe,
    check_gptq_settings,
    refuse_global_overrides,
)
from lowbit.recipes.linear_settings import GPTQRecipeSettings
from lowbit.recipes.registry import register, register_preset

# the paper's settings (Dettmers et al., 2024), as in Crnčević's thesis: 3-bit weights and
# statistics, beta 16/16, about 1% or 0.5% outliers
register_preset("spqr-w3-1pct", "spqr", {})
register_preset("spqr-w3-0.5pct", "spqr", {"outlier_fraction": 0.005})


@register
@dataclass
class SpQRRecipe(GPTQRecipeSettings, Recipe):
    """SpQR weights (block linears); activations and KV cache untouched.

    Settings:
        w_bits: code width (3 for the packed layout; 2-8 simulated).
        beta1: columns per first-order group (16 packed).
        beta2: rows per second-order group (16 packed).
        stat_bits: width of the quantized scales and zeros (3 packed).
        outlier_fraction: the outlier budget, a share of each layer's weights in [0, 0.1].
        tau: SpQR's relative outlier threshold; none = found per layer to fill the budget.
        simplified: find likely outliers by saliency instead of SpQR's leave-one-out test.
        sparse_format: stored outlier layout, csr or ptcsr.
        act_order, block_size, damp, guard, heldout_fraction, sequential: GPTQ's (see
            ``gptq``); the guard is off by default (SpQR's uncalibrated candidate costs as
            much as the calibrated one and holds out samples from the Hessians).
    """

    method = "spqr"
    roles = frozenset({"weights"})
    streams = True
    paper = "SpQR (Dettmers et al., 2024)"
    needs_calibration = True

    w_bits: int = 3
    beta1: int = 16
    beta2: int = 16
    stat_bits: int = 3
    outlier_fraction: float = 0.01
    tau: float | None = None
    simplified: bool = False
    sparse_format: Literal["csr", "ptcsr"] = "csr"
    guard: bool = False  # GPTQ's setting, off here (see above)

    gptq_weights = True

    def validate(self) -> None:
        self.weight_spec()  # the spec checks the format's settings, one sentence each
        check_gptq_settings(self)
        if not 0.0 <= self.outlier_fraction <= MAX_OUTLIER_FRACTION:  # pragma: no cover
            raise LowbitError("outlier_fraction out of range")

    def weight_spec(self) -> SpQRSpec:
        return SpQRSpec(
            bits=self.w_bits,
            beta1=self.beta1,
            beta2=self.beta2,
            stat_bits=self.stat_bits,
            outlier_fraction=self.outlier_fraction,
            tau=self.tau,
            simplified=self.simplified,
            sparse_format=self.sparse_format,
        )

    def apply(self, model, context: QuantizeContext) -> None:
        refuse_global_overrides(self.method, context.overrides, self.gptq_setting_names())
        model.lowbit_weight_report = quantize_linears(
            model,
            context.adapter,
            spec_for=lambda fqn: context.recipe_for(self, fqn).weight_spec(),
            algo="gptq",
            calibration=context.calibration,
            filter_fn=context.selected,
            gptq=self.gptq_settings(),
            progress=context.progress,
            hooks=context.blocks,
            resume_dir=context.resume_dir,
            recipe=context.resume_fingerprint(self),
            device=context.device,
        )
