"""One packed linear on the CPU: reference, torch.compile'd reference, torch-cpu, dense float.

Per SmolLM2 layer shape (N x K = 576x576, 1536x576, 576x1536), weight format (W2/W3/W4 g64,
W8 per channel), input dtype (fp32, bf16) and rows M (1 = decoding, 16, 512 = prefill): the
time of ``layer(x)`` on the ``reference`` backend, on the reference compiled by Inductor
(``torch.compile`` of unpack + scale + ``F.linear``, one graph per shape), on ``torch-cpu``
(4 and 8 bits), and of ``F.linear`` with the float weight. Also the max |difference| of the
compiled and torch-cpu outputs from the reference. Command::

    python benchmarks/bench_cpu_backends.py --out docs/results/cpu_backends.md
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, markdown_table, stamp  # noqa: E402

SHAPES = [(576, 576), (1536, 576), (576, 1536)]
FORMATS = [(2, 64), (3, 64), (4, 64), (8, None)]


def timed(seconds: float, fn, *fn_args) -> float:
    """Mean time of ``fn(*fn_args)`` in microseconds over about ``seconds``, after 3 warm-ups."""
    for _ in range(3):
        fn(*fn_args)
    start, n = time.perf_counter(), 0
    while time.perf_counter() - start < seconds:
        fn(*fn_args)
        n += 1
    return (time.perf_counter() - start) / n * 1e6


def main() -> None:
    import torch
    import torch.nn.functional as F

    from lowbit.formats.intq import IntQuantized
    from lowbit.nn.packed_linear import PackedLinear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 512])
    parser.add_argument("--seconds", type=float, default=0.5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    load_before = os.getloadavg()[0]

    def product(x, layer):  # the reference backend's arithmetic, as one function to compile
        return F.linear(x, layer.dequantize_weight(x.dtype))

    compiled = torch.compile(product, dynamic=False)
    header = ["N x K", "format", "dtype", "M", "reference µs", "compiled µs", "torch-cpu µs",
              "dense µs", "ref / torch-cpu", "max |Δ| compiled, torch-cpu"]  # fmt: skip
    rows = []
    for n, k in SHAPES:
        weight = torch.randn(n, k)
        for bits, group in FORMATS:
            q = IntQuantized.from_float(weight, bits, group_size=group, scale_dtype=torch.float16)
            reference = PackedLinear.from_quantized(q, backend="reference")
            fast = PackedLinear.from_quantized(q, backend="torch-cpu")
            # dynamo recompiles per layer (a new closure): a fresh cache keeps it under its limit
            torch._dynamo.reset()
            for dtype in (torch.float32, torch.bfloat16):
                dense = weight.to(dtype)
                for m in args.rows:
                    x = torch.randn(m, k).to(dtype)
                    want = reference(x)
                    t_ref = timed(args.seconds, reference, x)
                    t_comp = timed(args.seconds, compiled, x, reference)
                    d_comp = (compiled(x, reference) - want).abs().max().item()
                    t_fast = d_fast = None
                    if bits in (4, 8):
                        t_fast = timed(args.seconds, fast, x)
                        d_fast = (fast(x).float() - want.float()).abs().max().item()
                    t_dense = timed(args.seconds, F.linear, x, dense)
                    fmt = f"W{bits} " + (f"g{group}" if group else "per-channel")
                    rows.append([
                        f"{n}x{k}", fmt, str(dtype)[6:], m, f"{t_ref:.0f}", f"{t_comp:.0f}",
                        "—" if t_fast is None else f"{t_fast:.0f}", f"{t_dense:.0f}",
                        "—" if t_fast is None else f"{t_ref / t_fast:.1f}",
                        f"{d_comp:.1e}, " + ("—" if d_fast is None else f"{d_fast:.1e}"),
                    ])  # fmt: skip
                    print(" | ".join(map(str, rows[-1])), flush=True)
    text = (
        f"{stamp(command_line())} Load average (1 min) {load_before:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after.\n\n{markdown_table(header, rows)}\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
