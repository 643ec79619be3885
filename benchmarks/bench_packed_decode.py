"""One layer's decode attention over a packed KV cache, beside torch's fused attention over the
same keys and values in a float cache, against context length.

Random keys and values of a model's KV shape (default Llama-3-8B's: 8 KV heads of 128 channels,
32 query heads) are stored by a layer of each packed format in prefill chunks of 4,096 tokens;
then one decode query attends over them. Timed: the attention alone (a step's store of its new
token is not), the median of ``--steps`` calls after two warm-up calls. On CUDA the packed rows
run lowbit's Triton kernels (:mod:`lowbit.kv.triton_decode`), on the CPU its compiled C kernels;
the peer is ``torch.nn.functional.scaled_dot_product_attention`` over the float cache in
``--dtype`` (float16 on CUDA by default), in the same process. Keys are cached as given (no
RoPE in either row); KVQuant's rows keep 1 % sparse outliers (keys: the elements outside their
channel's range, set to the normal distribution's 1 % tails; values: each token's 1 % largest)
or none. Random data: for time and memory only.

    python benchmarks/bench_packed_decode.py --device cuda --contexts 4096 32768 131072
    python benchmarks/bench_packed_decode.py --device cpu --dtype float32 --contexts 8192
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import command_line, stamp  # noqa: E402

from lowbit.atomic import atomic_file, check_target  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.kv.cache import QuantizedKVLayer  # noqa: E402
from lowbit.kv.int_quant import IntTokenQuantizer  # noqa: E402
from lowbit.kv.kvquant import KVQuantQuantizer  # noqa: E402


def _kv_int(bits):
    return lambda heads, dim: (IntTokenQuantizer(bits), IntTokenQuantizer(bits))


def _kvquant(bits, outliers):
    def make(heads, dim):
        keys = KVQuantQuantizer(bits, heads, dim, per_channel=True, outlier_fraction=outliers)
        # the random keys' range as calibration would set it: 1 % outside, or 3.3 sigma
        keys.half_range.fill_(2.576 if outliers else 3.3)
        return keys, KVQuantQuantizer(bits, heads, dim, outlier_fraction=outliers)

    return make


#: row name -> (heads, dim) -> (key quantizer, value quantizer)
ROWS = {
    "kv-int 4": _kv_int(4),
    "kv-int 2": _kv_int(2),
    "kvquant 4": _kvquant(4, 0.01),
    "kvquant 3": _kvquant(3, 0.01),
    "kvquant 4, no outliers": _kvquant(4, 0.0),
}
CHUNK = 4096  # tokens a prefill call stores


def fill(name, keys, values):
    """A layer of row ``name`` holding ``keys``, ``values`` ``[1, H, T, D]``."""
    key_q, value_q = ROWS[name](keys.shape[1], keys.shape[3])
    layer = QuantizedKVLayer(
        key_q.to(keys.device), value_q.to(keys.device), residual_dtype=keys.dtype
    )
    for lo in range(0, keys.shape[2], CHUNK):
        layer.store(keys[:, :, lo : lo + CHUNK], values[:, :, lo : lo + CHUNK])
    return layer


def _median_ms(fn, steps, device):
    times = []
    for i in range(steps + 2):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 2:
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def table(device, dtype, contexts, heads, kv_heads, dim, steps, rows, attend=None):
    """The markdown table: per context the float cache's fused attention, then each packed
    row (``attend(q, layer, scaling=...)``, default lowbit's dispatch), ms a call and the
    ratio to the float row, with the cache bytes of each."""
    from lowbit.kv.decode import chunked_attention

    attend = attend or chunked_attention
    g = torch.Generator(device="cpu").manual_seed(0)
    lines = [
        "| context | KV cache | ms a call | × float | cache MB | × float bytes |",
        "|---|---|---|---|---|---|",
    ]
    scaling = dim**-0.5
    for context in contexts:
        keys = torch.randn(1, kv_heads, context, dim, generator=g).to(device, dtype)
        values = torch.randn(1, kv_heads, context, dim, generator=g).to(device, dtype)
        q = torch.randn(1, heads, 1, dim, generator=g).to(device, dtype)
        float_bytes = 2 * keys.numel() * keys.element_size()

        def fused(keys=keys, values=values, q=q):
            return torch.nn.functional.scaled_dot_product_attention(
                q, keys, values, scale=scaling, enable_gqa=heads != kv_heads
            )

        base = _median_ms(fused, steps, device)
        lines.append(
            f"| {context:,} | float ({str(dtype).removeprefix('torch.')}, SDPA) | {base:.3f} "
            f"| 1.00 | {float_bytes / 1e6:.1f} | 1.000 |"
        )
        for name in rows:
            layer = fill(name, keys, values)
            call = lambda layer=layer, q=q: attend(q, layer, scaling=scaling)  # noqa: E731
            if call() is None:
                lines.append(f"| {context:,} | {name} | not read by the kernels | | | |")
                continue
            ms = _median_ms(call, steps, device)
            nbytes = layer.nbytes()
            lines.append(
                f"| {context:,} | {name} | {ms:.3f} | {base / ms:.2f} | {nbytes / 1e6:.1f} "
                f"| {nbytes / float_bytes:.3f} |"
            )
            del layer
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["float16", "bfloat16", "float32"], default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096, 32768, 131072])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    parser.add_argument("--out", type=Path, default=None, help="also write the table here")
    parser.add_argument("--force", action="store_true", help="replace an existing --out file")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_packed_decode: --device cuda, but torch sees no CUDA device")
    if args.heads % args.kv_heads:
        sys.exit("bench_packed_decode: --heads must be a multiple of --kv-heads")
    if args.out is not None:  # refused before the run, not after it
        try:
            check_target(args.out, "write the table to", kind="file", force=args.force)
        except LowbitError as err:
            sys.exit(f"bench_packed_decode: {err}")
    dtype = getattr(torch, args.dtype or ("float16" if device.type == "cuda" else "float32"))
    out = table(device, dtype, args.contexts, args.heads, args.kv_heads, args.dim, args.steps,
                args.rows)  # fmt: skip
    text = stamp(command_line())
    if device.type == "cuda":
        text += f" Device: {torch.cuda.get_device_name(device)}."
    text += f"\n\n{out}\n"
    print(text)
    if args.out is not None:
        with atomic_file(args.out, verb="write the table to", force=args.force) as tmp:
            tmp.write_text(text)


if __name__ == "__main__":
    main()
