"""The ``kvquant`` recipe: KVQuant's KV cache (Hooper et al., 2024), every component switchable.

Full method (defaults): 3-bit nuqX keys per channel before RoPE and values per token, codebooks
fitted per layer with Fisher weights, 1% fp16 outliers, the first token in fp16, and, beyond
the paper, each value token coded in a randomized-Hadamard basis over head_dim
(``rotate_values``) and each layer's outliers shared between its keys and values where they cut
the most Fisher-weighted error (``share_outliers``; the values keep 0, ½, 1 or 1½ times their
even count per token, the keys the rest, so the bytes do not change). Switching
components off in order walks the paper's ablation ladder; the ``kvquant-ladder-*`` presets are
its rungs (``kvquant-ladder-sink`` is the paper's full method), so ``lowbit eval --recipe
kvquant-ladder-int --recipe kvquant-ladder-channel ... --recipe kvquant --set bits=3`` prints it
in one command.

Calibration: the first token of each sample (the attention sink) calibrates the key ranges and
outlier thresholds only when the cache quantizes it (``sink_tokens=0``): many of its key
channels lie outside every other token's range (see :mod:`lowbit.kv.fisher`). Codebooks are
always fitted without it, as KVQuant does: its loss gradients are orders of magnitude larger
than any other token's, so with it the Fisher-weighted fit spends levels on one token
(docs/results/kv-cache.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.errors import LowbitError
from lowbit.kv.attention import install_kv_quantization
from lowbit.kv.cache import KVCacheLayout
from lowbit.kv.fisher import KVCalibration, collect_kv_fisher
from lowbit.kv.kvquant import KVQuantQuantizer, check_outlier_allocation, token_rotation
from lowbit.recipes.base import OFF_BITS, QuantizeContext, Recipe, check_bits, check_kv_fits
from lowbit.recipes.registry import register, register_preset
from lowbit.settings import Count

_LADDER = {
    "kvquant-ladder-int": dict(
        per_channel_keys=False, pre_rope=False, nuq=False, outlier_fraction=0.0, sink_tokens=0
    ),
    "kvquant-ladder-channel": dict(pre_rope=False, nuq=False, outlier_fraction=0.0, sink_tokens=0),
    "kvquant-ladder-prerope": dict(nuq=False, outlier_fraction=0.0, sink_tokens=0),
    "kvquant-ladder-nuq": dict(outlier_fraction=0.0, sink_tokens=0),
    "kvquant-ladder-outliers": dict(sink_tokens=0),
    "kvquant-ladder-sink": {},
}
#: KVQuant's ablation ladder in order, then the full ``kvquant`` (value rotation, shared
#: outliers)
LADDER = (*_LADDER, "kvquant")
# the paper's rungs code values as they come and give each stream outlier_fraction
for _name, _settings in _LADDER.items():
    register_preset(
        _name, "kvquant", {**_settings, "rotate_values": False, "share_outliers": False}
    )


@register
@dataclass
class KVQuantRecipe(Recipe):
    """KVQuant's KV cache: Fisher-weighted non-uniform codebooks, keys per channel before RoPE,
    sparse fp16 outliers and an fp16 attention sink.

    Settings: :mod:`lowbit.recipes.settings_help` describes each (``lowbit recipes`` prints
    them).
    """

    method = "kvquant"
    needs_calibration = True
    roles = frozenset({"kv"})
    paper = "KVQuant (Hooper et al., 2024)"

    bits: int = 3
    k_bits: int | None = None
    v_bits: int | None = None
    outlier_fraction: float = 0.01
    outlier_allocation: str = "least-error"
    sink_tokens: Count = 1
    pre_rope: bool = True
    per_channel_keys: bool = True
    channel_codebooks: bool = False
    rotate_values: bool = True
    share_outliers: bool = True
    nuq: bool = True
    fisher: bool = True
    calib_tokens: int = 8192

    @property
    def key_bits(self) -> int:
        return self.bits if self.k_bits is None else self.k_bits

    @property
    def value_bits(self) -> int:
        return self.bits if self.v_bits is None else self.v_bits

    def validate(self) -> None:
        check_bits("bits", self.bits, allow_off=False)
        for name in ("k_bits", "v_bits"):
            if getattr(self, name) is not None:
                check_bits(name, getattr(self, name))
        if not 0.0 <= self.outlier_fraction < 0.5:
            raise LowbitError(f"outlier_fraction must be in [0, 0.5), not {self.outlier_fraction}")
        check_outlier_allocation(self.outlier_allocation)
        if isinstance(self.sink_tokens, bool) or self.sink_tokens < 0:
            raise LowbitError(f"sink_tokens must be a non-negative integer, not {self.sink_tokens}")
        if self.channel_codebooks and not self.per_channel_keys:
            raise LowbitError("channel_codebooks needs per_channel_keys (per-channel key ranges)")
        if isinstance(self.calib_tokens, bool) or self.calib_tokens < 1:
            raise LowbitError(f"calib_tokens must be a positive integer, not {self.calib_tokens}")

    def nothing_to_do(self) -> str | None:
        if self.key_bits == OFF_BITS and self.value_bits == OFF_BITS:
            return "k_bits=16 and v_bits=16 leave the cache in float (KV bits are 2-8)"
        return None

    def check_model(self, model, context: QuantizeContext) -> None:
        keys, values = self.quantizers(context.adapter, None)
        check_kv_fits(context.adapter, [*keys, *values])

    @property
    def needs_gradients(self) -> bool:
        return self.fisher and (self.nuq or self.shares_outliers)

    def quantizers(self, adapter, calib: KVCalibration | None) -> tuple[list, list]:
        """Per-layer key and value quantizers, calibrated on ``calib`` (None: uncalibrated,
        for the bytes accounting only)."""
        h, d = adapter.num_kv_heads, adapter.head_dim
        if calib is not None:  # sinks kept in fp16 stay out of calibration (as in KVQuant)
            calib = calib.without_leading(self.sink_tokens)
        # the value basis of rotate_values, built once: its Fisher weights are those of x @ R
        rotate = self.rotate_values and calib is not None
        rotation = token_rotation(d, calib.device) if rotate else None  # [D, D]
        shared = calib is not None and calib.has_gradients and self.shares_outliers
        splits = self.outlier_splits(h * d) if shared else [(self.outlier_fraction,) * 2]
        keys, values = [], []
        for layer in range(adapter.num_layers):
            # each stream's calibration samples and Fisher weights, read once for every split
            data = dict.fromkeys("kv")
            if calib is not None:
                data = {s: self._samples(adapter, calib, layer, s, rotation) for s in "kv"}
            pairs = [
                tuple(
                    self._quantizer(adapter, calib, stream, fraction, data[stream])
                    for stream, fraction in zip("kv", split, strict=True)
                )
                for split in splits
            ]
            key, value = pairs[0]
            if len(pairs) > 1:  # keys and values as the model sees them (values unrotated)
                targets = [self._samples(adapter, calib, layer, stream) for stream in "kv"]
                kept = calib.positions >= 1  # the first token's gradients dwarf every other's
                key, value = min(pairs, key=lambda pair: _added_loss(pair, targets, kept))
            keys.append(key)
            values.append(value)
        return keys, values

    @property
    def shares_outliers(self) -> bool:
        """Whether each layer's keys and values share their outliers (``share_outliers`` with
        both streams quantized, outliers kept and Fisher information to split them by)."""
        both = OFF_BITS not in (self.key_bits, self.value_bits)
        return self.share_outliers and both and self.outlier_fraction > 0 and self.fisher

    def outlier_splits(self, hidden: int) -> list[tuple[float, float]]:
        """The (key, value) outlier fractions ``share_outliers`` chooses from for each layer of
        ``hidden = H_kv * D`` channels: the values keep 0, ½, 1 or 1½ times their even count per
        token (``round(outlier_fraction * hidden)``), the keys take the difference, so every
        split stores as many outliers per token as the even one."""
        even = round(self.outlier_fraction * hidden)
        counts = sorted({round(even * share) for share in (0, 0.5, 1, 1.5)})
        splits = [(self.outlier_fraction + (even - n) / hidden, n / hidden) for n in counts]
        return [(k, v) for k, v in splits if k >= 0]

    def _quantizer(
        self,
        adapter,
        calib: KVCalibration | None,
        stream: str,
        outlier_fraction: float,
        data: tuple[Tensor, Tensor | None] | None,
    ) -> KVQuantQuantizer | None:
        """A layer's quantizer of ``stream`` ("k" or "v") calibrated on ``data``, that layer's
        ``(samples, fisher)`` from :meth:`_samples` (None without ``calib``); None when the stream
        stays in fp16."""
        key = stream == "k"
        bits = self.key_bits if key else self.value_bits
        if bits == OFF_BITS:
            return None
        settings = dict(
            bits=bits,
            per_channel=self.per_channel_keys if key else False,
            outlier_fraction=outlier_fraction,
            channel_codebooks=self.channel_codebooks if key else False,
            rotate=False if key else self.rotate_values,
        )
        if calib is None:
            h, d = adapter.num_kv_heads, adapter.head_dim
            return KVQuantQuantizer(num_heads=h, head_dim=d, **settings)
        samples, fisher = data
        return KVQuantQuantizer.calibrate(
            samples,
            fisher if self.fisher else None,
            nuq=self.nuq,
            outlier_allocation=self.outlier_allocation,
            codebook_tokens=calib.positions >= 1,
            **settings,
        )

    def _samples(self, adapter, calib: KVCalibration, layer: int, stream: str, rotation=None):
        grads = calib.has_gradients
        if stream == "v":
            return calib.values[layer], calib.value_fisher(layer, rotation) if grads else None
        if self.pre_rope:
            return calib.keys[layer], calib.key_fisher(layer) if grads else None
        # post-RoPE ranges must hold at every position served, not only the calibration ones;
        # leading tokens (sinks, when quantized) stay where they are
        context = max(adapter.max_context, int(calib.positions.max()) + 1)
        generator = torch.Generator(device="cpu").manual_seed(layer)  # the same on every device
        drawn = torch.randint(1, context, (calib.num_tokens,), generator=generator, device="cpu")
        drawn = drawn.to(calib.positions.device)  # [N]
        positions = torch.where(calib.positions == 0, calib.positions, drawn)
        return calib.post_rope_keys(adapter, layer, positions)

    def calibrate(self, model, context: QuantizeContext) -> KVCalibration:
        """The Fisher pass (activations only when no codebook is Fisher-weighted), on the
        context's compute device; the result is on the CPU."""
        if context.calibration is None:
            raise LowbitError("recipe 'kvquant' needs calibration data (calibration=...)")
        return collect_kv_fisher(
            model,
            context.adapter,
            context.calibration,
            max_tokens=self.calib_tokens,
            gradients=self.needs_gradients,
            progress=context.progress,
            device=context.device,
        )

    def install(self, model, adapter, keys: list, values: list) -> KVCacheLayout:
        return install_kv_quantization(
            model,
            adapter,
            key_quantizers=keys,
            value_quantizers=values,
            pre_rope=self.pre_rope,
            sink_tokens=self.sink_tokens,
            residual_dtype=torch.float16,
        )

    def apply(self, model, context: QuantizeContext) -> None:
        calib = self.calibrate(model, context).to(context.compute_device())  # fitted there
        keys, values = self.quantizers(context.adapter, calib)  # moved to each layer on install
        self.install(model, context.adapter, keys, values)

    def kv_bytes_per_token(self, adapter, context_length: int) -> float | None:
        keys, values = self.quantizers(adapter, None)
        layout = KVCacheLayout(
            keys,
            values,
            sink_tokens=self.sink_tokens,
            residual_dtype=torch.float16,
            track_positions=self.pre_rope,
        )
        return layout.bytes_per_token(adapter.num_kv_heads, adapter.head_dim, context_length)


def _added_loss(pair: tuple, targets: list[tuple[Tensor, Tensor]], kept: Tensor) -> float:
    """``Σ F (x̂ - x)²`` of a layer's key and value quantizers ``pair`` over the calibration
    samples ``x`` ``[N, H, D]`` and Fisher information ``F`` of ``targets`` (one per stream)
    at the tokens ``kept`` ``[N]``: the loss their quantization adds, to second order."""
    total = 0.0
    for quantizer, (samples, fisher) in zip(pair, targets, strict=True):
        x = samples[kept].transpose(0, 1).unsqueeze(0).float()  # [1, H, N, D]
        weights = fisher[kept].transpose(0, 1).unsqueeze(0).float()
        total += float((weights * (quantizer.fake_quant(x) - x).square()).sum())
    return total
