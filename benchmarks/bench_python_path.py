"""The Python around one packed linear call on the triton backend, with the kernel launch stubbed.

A decode step calls ~210 packed linears; whatever Python runs around each launch (dispatch,
checks, buffers) is paid per call on the host and, unless the step is a CUDA graph, delays
every launch. This measures it on the CPU: Triton's interpreter is selected so the backend
accepts CPU tensors, and its kernel entry is replaced by a no-op, so what is timed is lowbit's
path alone (the launch itself is Triton's). Beside it: a bare ``F.linear`` on a 1 x 16 input
(torch's own per-call cost), and with ``--baseline-src`` the same measurement of another
checkout's ``src`` (the code before a change) in a subprocess. ::

    python benchmarks/bench_python_path.py
    python benchmarks/bench_python_path.py --baseline-src /work/main/src
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before Triton is imported: CPU tensors are accepted

FORMATS = ("int 4-bit g128", "int 4-bit g128 asym", "spqr 3-bit 1%", "mixed 2/4 25%")


def _layers(n: int, k: int):
    import torch

    from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
    from lowbit.algorithms.spqr import SpQRSpec
    from lowbit.formats.intq import IntQuantized
    from lowbit.nn.mixed_linear import MixedLinear
    from lowbit.nn.packed_linear import PackedLinear
    from lowbit.nn.spqr_linear import SpQRLinear

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=gen) * 0.02
    bias = torch.randn(n, generator=gen) * 0.02
    sym = IntQuantized.from_float(w, 4, group_size=128, scale_dtype=torch.float16)
    asym = IntQuantized.from_float(w, 4, group_size=128, symmetric=False, scale_dtype=torch.float16)
    spqr = SpQRSpec(outlier_fraction=0.01).rtn(w)
    mixed = mixed_quantize(w, None, MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.01))
    return {
        FORMATS[0]: PackedLinear.from_quantized(sym, bias, backend="triton"),
        FORMATS[1]: PackedLinear.from_quantized(asym, bias, backend="triton"),
        FORMATS[2]: SpQRLinear.from_quantized(spqr, bias, backend="triton"),
        FORMATS[3]: MixedLinear.from_quantized(mixed.quantized, bias, backend="triton"),
    }


def _per_call_us(fn, calls: int, repeats: int = 5) -> float:
    """Median over ``repeats`` of the mean time of ``calls`` calls, in microseconds."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls * 1e6)
    return sorted(times)[len(times) // 2]


def measure(n: int, k: int, rows: int, calls: int) -> dict[str, float]:
    """us per call of each format's packed linear (launch stubbed) and of a bare F.linear."""
    import torch
    import torch.nn.functional as F
    from triton.runtime import interpreter

    torch.set_num_threads(1)
    layers = _layers(n, k)
    x = torch.randn(rows, k, dtype=torch.float16)
    results = {}
    with torch.no_grad():
        for name, layer in layers.items():
            layer.to(torch.float16)
            layer(x)  # prepares the layout and picks the launch configuration (real kernels)
            run = interpreter.InterpretedFunction.run
            interpreter.InterpretedFunction.run = lambda self, *a, **kw: None  # the stub
            try:
                results[name] = _per_call_us(lambda layer=layer: layer(x), calls)
            finally:
                interpreter.InterpretedFunction.run = run
        small_x, small_w = torch.randn(rows, 16), torch.randn(16, 16)
        results["bare F.linear 16x16"] = _per_call_us(lambda: F.linear(small_x, small_w), calls)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", default="512x512", help="N x K of the layers (default 512x512)")
    parser.add_argument("--rows", type=int, default=1, help="M, the rows of the input")
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--baseline-src", help="another checkout's src/ to measure beside this")
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    ours = measure(n, k, args.rows, args.calls)
    if args.json:
        print(json.dumps(ours))
        return
    base = None
    if args.baseline_src:
        env = dict(os.environ, PYTHONPATH=args.baseline_src)
        cmd = [sys.executable, str(Path(__file__).resolve()), "--json", "--shape", args.shape,
               "--rows", str(args.rows), "--calls", str(args.calls)]  # fmt: skip
        run = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if run.returncode != 0:
            sys.exit(f"the baseline run failed: {run.stderr.strip().splitlines()[-1]}")
        base = json.loads(run.stdout.strip().splitlines()[-1])
    print(f"packed linear call, launch stubbed: {n}x{k}, M = {args.rows}, fp16, bias, "
          f"{args.calls} calls x 5 (median), 1 thread")  # fmt: skip
    header = "| call | us per call |"
    if base:
        header += " baseline us | baseline / this |"
    print(header + " / bare F.linear |")
    print("|---" * (header.count("|") - 1 + 1) + "|")
    bare = ours["bare F.linear 16x16"]
    for name, us in ours.items():
        row = f"| {name} | {us:.1f} |"
        if base:
            row += f" {base[name]:.1f} | {base[name] / us:.2f} |"
        print(row + f" {us / bare:.1f} |")


if __name__ == "__main__":
    main()
