"""Activation Fisher information of the cached keys and values (KVQuant, Hooper et al., 2024, §3.3).

The diagonal Fisher information of an activation ``a`` is ``(dL/da)**2``, ``L`` the language
modelling loss on calibration text. KVQuant weights its codebook fitting by it. One pass per
calibration sample: the float model runs forward with hooks that keep the key and value
activations of every layer (``retain_grad``), the loss is backpropagated (to activations only:
no parameter gradients are formed), and a fixed random subset of token positions is kept.

Keys are captured where a pre-RoPE cache stores them: the output of ``k_proj`` (after
``k_norm`` on Qwen3), before RoPE. The post-RoPE keys and their Fisher weights follow exactly
from the kept positions (:meth:`KVCalibration.post_rope_keys`): RoPE is a rotation ``R_m`` per
position, so ``k_post = R_m k_pre`` and ``dL/dk_post = R_m dL/dk_pre``.

The first token of every sample (the attention sink) is always kept, beside a random subset
of the others: its statistics are atypical (many of its key channels lie outside every other
token's range, and its Fisher information is orders of magnitude larger; the figures are in
docs/results/kv-cache.md), so a cache that keeps it in fp16 masks it out of calibration, as
KVQuant does (:meth:`KVCalibration.without_leading`), and a cache that quantizes it must
calibrate on it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from lowbit.errors import LowbitError

__all__ = ["KVCalibration", "collect_kv_fisher", "MIN_CALIBRATION_TOKENS"]

#: fewest non-sink calibration tokens the KV calibration accepts (a 1% per-channel quantile
#: needs at least ~100 samples to mean anything)
MIN_CALIBRATION_TOKENS = 128


@dataclass
class KVCalibration:
    """Key/value activations and their loss gradients at ``N`` kept token positions.

    Attributes (one list entry per layer):
        keys: pre-RoPE keys ``[N, H_kv, D]`` fp32.
        key_grads: ``dL/dkeys`` ``[N, H_kv, D]`` fp32 (None: collected without gradients).
        values: ``[N, H_kv, D]`` fp32.
        value_grads: ``dL/dvalues`` ``[N, H_kv, D]`` fp32 (None: without gradients).
        positions: ``[N]`` position of each kept token inside its sample.
        samples: ``[N]`` index of the calibration sample each kept token comes from.
    """

    keys: list[Tensor]
    key_grads: list[Tensor] | None
    values: list[Tensor]
    value_grads: list[Tensor] | None
    positions: Tensor
    samples: Tensor

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.numel())

    @property
    def has_gradients(self) -> bool:
        return self.key_grads is not None

    @property
    def device(self) -> torch.device:
        """Where the activations are (every tensor of a calibration is on one device)."""
        return self.positions.device

    def to(self, device: torch.device | str) -> KVCalibration:
        """This calibration with every tensor on ``device`` (itself when already there)."""
        device = torch.device(device)
        if self.device == device:
            return self

        def move(x: list[Tensor] | None) -> list[Tensor] | None:
            return None if x is None else [t.to(device) for t in x]

        return KVCalibration(
            keys=move(self.keys),
            key_grads=move(self.key_grads),
            values=move(self.values),
            value_grads=move(self.value_grads),
            positions=self.positions.to(device),
            samples=self.samples.to(device),
        )

    def without_leading(self, tokens: int) -> KVCalibration:
        """The kept positions from ``tokens`` on (drop the sinks a cache keeps in fp16)."""
        keep = self.positions >= tokens  # [N]

        def pick(x: list[Tensor] | None) -> list[Tensor] | None:
            return None if x is None else [t[keep] for t in x]

        return KVCalibration(
            keys=pick(self.keys),
            key_grads=pick(self.key_grads),
            values=pick(self.values),
            value_grads=pick(self.value_grads),
            positions=self.positions[keep],
            samples=self.samples[keep],
        )

    def _grads(self, grads: list[Tensor] | None, layer: int) -> Tensor:
        if grads is None:
            raise LowbitError("this KV calibration was collected without gradients (no Fisher)")
        return grads[layer]

    def key_fisher(self, layer: int) -> Tensor:
        """Diagonal Fisher information of the pre-RoPE keys: ``[N, H_kv, D]``."""
        return self._grads(self.key_grads, layer).square()

    def value_fisher(self, layer: int, rotation: Tensor | None = None) -> Tensor:
        """Diagonal Fisher information of the values ``[N, H_kv, D]``, or of the rotated values
        ``values @ rotation`` (orthonormal ``[D, D]``: their gradients are ``grads @ rotation``)."""
        grads = self._grads(self.value_grads, layer)
        return (grads if rotation is None else grads @ rotation).square()

    def post_rope_keys(
        self, adapter, layer: int, positions: Tensor | None = None
    ) -> tuple[Tensor, Tensor | None]:
        """Keys after RoPE and their Fisher information (None without gradients), both
        ``[N, H_kv, D]``.

        Args:
            positions: ``[N]`` positions to rotate each kept key to; None = where it was.
                Calibration samples are usually shorter than the contexts served, so ranges
                of post-RoPE keys are better estimated at positions drawn over the context.
        """
        pos = (self.positions if positions is None else positions).unsqueeze(0)  # [1, N]
        parts = [self.keys[layer]] + ([self.key_grads[layer]] if self.has_gradients else [])
        both = torch.stack(parts)  # [P, N, H, D]
        rotated = adapter.apply_rope(both.transpose(1, 2), pos.expand(len(parts), -1))
        rotated = rotated.transpose(1, 2)  # [P, N, H, D]
        fisher = rotated[1].square() if self.has_gradients else None
        return rotated[0].contiguous(), fisher


def _kept_positions(
    n_samples: int, seqlen: int, max_tokens: int, generator: torch.Generator
) -> list[Tensor]:
    """Sorted positions kept per sample: 0 and a random subset of 1..seqlen-1, at most
    ``max(max_tokens, 2 * n_samples)`` in all."""
    per_sample = max(1, min(seqlen - 1, max_tokens // n_samples - 1))
    kept = []
    for _ in range(n_samples):
        order = torch.randperm(seqlen - 1, generator=generator, device="cpu")[:per_sample] + 1
        kept.append(torch.cat([order.new_zeros(1), order.sort().values]))
    return kept


def collect_kv_fisher(
    model: torch.nn.Module,
    adapter,
    calibration: Tensor,
    *,
    max_tokens: int = 8192,
    seed: int = 0,
    gradients: bool = True,
    progress: bool = False,
    device: torch.device | str | None = None,
    offload_device: torch.device | str = "cpu",
    block_by_block: bool | None = None,
) -> KVCalibration:
    """Run the float model on ``calibration`` and collect keys, values and their gradients.

    Args:
        model: the float causal LM (not modified; its parameters get no gradients).
        adapter: ``adapter_for(model)``.
        calibration: ``[n_samples, seqlen]`` token ids.
        max_tokens: keep at most this many token positions over all samples: the first of
            each sample and a random subset of the others drawn with ``seed`` (the same
            positions for every layer). Memory is
            ``16 * max_tokens * n_kv_heads * head_dim`` bytes per layer.
        seed: seed of the subset.
        gradients: backpropagate the loss for the Fisher information (False: activations
            only, one forward pass per sample).
        progress: show a progress bar over samples.
        device: compute device. None, or where the blocks are: the whole model runs there, one
            sample at a time. Elsewhere (a model on the CPU, ``device="cuda"``): block by
            block (:func:`_collect_block_by_block`), one block on ``device`` at a time.
        offload_device: where the block-by-block pass keeps its hidden states.
        block_by_block: force the pass (True) or the whole-model one (False); None chooses by
            ``device`` as above.

    Returns:
        :class:`KVCalibration` on ``offload_device``; token ids may be on any device.
    """
    if not isinstance(calibration, Tensor) or calibration.dim() != 2:
        raise LowbitError("calibration must be a [n_samples, seqlen] tensor of token ids")
    n_samples, seqlen = calibration.shape
    usable = n_samples * (seqlen - 1)
    if seqlen < 2 or usable < MIN_CALIBRATION_TOKENS:
        raise LowbitError(
            f"calibration has {max(usable, 0)} tokens after masking the first token of each "
            f"sample; the KV Fisher pass needs at least {MIN_CALIBRATION_TOKENS} "
            "(use more or longer calibration samples)"
        )
    from tqdm.auto import tqdm

    generator = torch.Generator(device="cpu").manual_seed(seed)  # same positions on every device
    kept = _kept_positions(n_samples, seqlen, max_tokens, generator)
    home = next(adapter.blocks_module.parameters()).device
    device = home if device is None else torch.device(device)
    if block_by_block or (block_by_block is None and device != home):
        out = _collect_block_by_block(
            model, adapter, calibration, kept, gradients, device,
            torch.device(offload_device), progress,
        )  # fmt: skip
        return _calibration(out, kept, gradients, offload_device)
    blocks = adapter.blocks()
    h_kv, d = adapter.num_kv_heads, adapter.head_dim
    captured: dict[tuple[str, int], Tensor] = {}

    def capture(kind: str, layer: int):
        def hook(module, args, output):
            if gradients:
                output.retain_grad()
            captured[(kind, layer)] = output

        return hook

    def make_leaf(module, args, output):
        return output.detach().requires_grad_(True)  # gradients start here, not at parameters

    handles = [adapter.embed_tokens.register_forward_hook(make_leaf)] if gradients else []
    for view in blocks:
        key_module = view.k_norm if view.k_norm is not None else view.k_proj
        handles.append(key_module.register_forward_hook(capture("k", view.index)))
        handles.append(view.v_proj.register_forward_hook(capture("v", view.index)))
    out = {name: [[] for _ in blocks] for name in ("k", "gk", "v", "gv")}
    was_training = model.training
    requires = [p.requires_grad for p in model.parameters()]
    try:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        device = adapter.embed_tokens.weight.device
        for i in tqdm(range(n_samples), desc="kv fisher", disable=not progress, leave=False):
            ids = calibration[i : i + 1].to(device)  # [1, S]
            captured.clear()
            with torch.set_grad_enabled(gradients):
                logits = model(ids, use_cache=False).logits[0, :-1].float()  # [S-1, V]
                if gradients:
                    loss = torch.nn.functional.cross_entropy(logits, ids[0, 1:])
                    loss.backward()
            pos = kept[i].to(device)
            for view in blocks:
                for kind, grad_kind in (("k", "gk"), ("v", "gv")):
                    act = captured[(kind, view.index)]
                    rows = act.detach()[0].reshape(seqlen, h_kv, d)[pos]  # [n, H, D]
                    out[kind][view.index].append(rows.float().to(offload_device))
                    if gradients:
                        grads = act.grad[0].reshape(seqlen, h_kv, d)[pos]
                        out[grad_kind][view.index].append(grads.float().to(offload_device))
            captured.clear()
    finally:
        for handle in handles:
            handle.remove()
        for p, flag in zip(model.parameters(), requires, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
    return _calibration(out, kept, gradients, offload_device)


def _calibration(out: dict, kept: list[Tensor], gradients: bool, device) -> KVCalibration:
    """The :class:`KVCalibration` of per-layer lists of per-sample rows ``out`` (on ``device``)."""
    positions = torch.cat(kept).to(device)  # [N]
    samples = torch.cat([torch.full_like(p, i) for i, p in enumerate(kept)]).to(device)
    return KVCalibration(
        keys=[torch.cat(x) for x in out["k"]],
        key_grads=[torch.cat(x) for x in out["gk"]] if gradients else None,
        values=[torch.cat(x) for x in out["v"]],
        value_grads=[torch.cat(x) for x in out["gv"]] if gradients else None,
        positions=positions,
        samples=samples,
    )


def _collect_block_by_block(
    model, adapter, calibration, kept, gradients, device, offload_device, progress
) -> dict[str, list[list[Tensor]]]:
    """The Fisher pass with one block on ``device`` at a time (the model stays where it is).

    Forward, block by block over all samples, keeping every block's input hidden states on
    ``offload_device`` (``(L + 1) * N * S * hidden`` elements); then the loss of each sample
    (final norm and lm_head on ``device``) and backward, block by block from the last:
    each block is run again on its kept input with gradients on, its output's gradient is
    backpropagated, and the key/value activations and gradients are read where the
    whole-model pass reads them. Parameters get no gradients.
    """
    from tqdm.auto import tqdm

    from lowbit.calibrate.capture import _move_outside_blocks, capture_first_block_inputs

    n_samples, seqlen = calibration.shape
    h_kv, d = adapter.num_kv_heads, adapter.head_dim
    blocks = adapter.blocks_module
    views = adapter.blocks()
    out = {name: [[] for _ in views] for name in ("k", "gk", "v", "gv")}
    requires = [p.requires_grad for p in model.parameters()]
    was_training = model.training
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    inputs = capture_first_block_inputs(
        model, adapter, calibration, offload_device=offload_device, device=device
    )
    hidden = [inputs.hidden]  # L + 1 of [N, S, hidden] on offload_device
    bar = tqdm(total=2 * len(views), desc="kv fisher", disable=not progress, leave=False)
    captured: dict[str, Tensor] = {}

    def capture(kind: str):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                output.retain_grad()
            captured[kind] = output

        return hook

    def keep(view, sample: int, with_grads: bool) -> None:
        pos = kept[sample].to(device)  # [n]
        for kind, grad_kind in (("k", "gk"), ("v", "gv")):
            act = captured[kind]
            rows = act.detach()[0].reshape(seqlen, h_kv, d)[pos]  # [n, H, D]
            out[kind][view.index].append(rows.float().to(offload_device))
            if with_grads:
                grads = act.grad[0].reshape(seqlen, h_kv, d)[pos]
                out[grad_kind][view.index].append(grads.float().to(offload_device))

    def run(view, x: Tensor) -> Tensor:
        y = view.block(x, **inputs.kwargs)
        return y[0] if isinstance(y, tuple) else y  # older transformers return (hidden, ...)

    try:
        for view in views:  # forward: every block's input, kept on offload_device
            home = next(view.block.parameters()).device
            key_module = view.k_norm if view.k_norm is not None else view.k_proj
            handles = [
                key_module.register_forward_hook(capture("k")),
                view.v_proj.register_forward_hook(capture("v")),
            ]
            view.block.to(device)
            try:
                following = torch.empty_like(hidden[-1])  # [N, S, hidden]
                with torch.no_grad():
                    for i in range(n_samples):
                        following[i : i + 1] = run(view, hidden[-1][i : i + 1].to(device))
                        if not gradients:
                            keep(view, i, with_grads=False)
                hidden.append(following)
            finally:
                for handle in handles:
                    handle.remove()
                view.block.to(home)
            bar.update(1 if gradients else 2)
        if not gradients:
            return out
        grad = torch.empty_like(hidden[-1])  # dL/d(block output) [N, S, hidden]
        outside_home = adapter.lm_head.weight.device
        _move_outside_blocks(model, blocks, device)
        try:
            for i in range(n_samples):
                ids = calibration[i, 1:].to(device)  # [S-1]
                x = hidden[-1][i : i + 1].to(device).requires_grad_(True)  # [1, S, hidden]
                with torch.enable_grad():
                    logits = adapter.lm_head(adapter.final_norm(x))[0, :-1].float()  # [S-1, V]
                    torch.nn.functional.cross_entropy(logits, ids).backward()
                grad[i : i + 1] = x.grad.to(offload_device)
        finally:
            _move_outside_blocks(model, blocks, outside_home)
        for view in reversed(views):  # backward, from the last block
            home = next(view.block.parameters()).device
            key_module = view.k_norm if view.k_norm is not None else view.k_proj
            handles = [
                key_module.register_forward_hook(capture("k")),
                view.v_proj.register_forward_hook(capture("v")),
            ]
            view.block.to(device)
            try:
                for i in range(n_samples):
                    x = hidden[view.index][i : i + 1].to(device).requires_grad_(True)
                    with torch.enable_grad():
                        run(view, x).backward(grad[i : i + 1].to(device))
                    keep(view, i, with_grads=True)
                    grad[i : i + 1] = x.grad.to(offload_device)
                    captured.clear()
            finally:
                for handle in handles:
                    handle.remove()
                view.block.to(home)
            hidden.pop()  # this block's output is no longer needed
            bar.update(1)
        return out
    finally:
        bar.close()
        for p, flag in zip(model.parameters(), requires, strict=True):
            p.requires_grad_(flag)
        model.train(was_training)
