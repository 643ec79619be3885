"""Round-to-nearest weight quantization: the uncalibrated baseline every method is measured by."""

from __future__ import annotations

import torch

from lowbit.formats.intq import IntQuantized

__all__ = ["rtn_quantize"]


def rtn_quantize(weight: torch.Tensor, spec) -> IntQuantized:
    """Quantize a [out, in] weight by rounding to nearest, with fp16 scales (and integer zeros).

    Args:
        weight: [out, in] float weight.
        spec: the integer format, an :class:`~lowbit.algorithms.int_spec.IntWeightSpec` (which
            calls this function, so it is not imported here).
    """
    spec.check(weight)
    return IntQuantized.from_float(
        weight.float(),
        spec.bits,
        symmetric=spec.symmetric,
        axis=-1,
        group_size=spec.group_size,
        mse_search=spec.mse_clip,
        scale_rule=spec.scale_rule,
        scale_dtype=torch.float16,  # what packed formats store; codes are chosen to match it
    )
