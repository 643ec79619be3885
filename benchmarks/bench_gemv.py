"""One packed linear, side by side: dense, torch's int4 kernel and lowbit's backends.

Per weight shape N x K and rows M: the time of ``x [M, K] @ Wᵀ``, the weight bandwidth it
achieves (bytes of codes + scales + zeros the kernel reads, over the time), that bandwidth's
share of a copy bandwidth measured in the same run, and the speed relative to the dense
product (fp16 cuBLAS on the GPU, fp32 ``F.linear`` on the CPU). ``err`` is the max |y - y_ref|
over max |y_ref| against the fp32 product with the same dequantized weight (a check that every
row computes what it claims). Weight bytes: the layout the kernel reads for torch's int4 and
lowbit's triton rows (3-bit words hold ten codes, rows padded to whole tiles), the canonical
packed storage (codes, fp16 scales, uint8 zeros) for the other lowbit rows.

GPU (the issue's table: cuBLAS fp16, ``aten._weight_int4pack_mm`` at 4 bits g128 in bf16, the
lowbit ``triton`` backend at W8/W4/W3 g128 and W2 g64, fp16 inputs; SpQR rows (``--formats
spqr`` alone): lowbit's fused SpQR kernel at 1% outliers with the outlier layout profiled, CSR,
PTCSR, and without outliers, and Crnčević's own CUDA SpQR kernel (master's thesis, 2025) from
the PyPI package ``spqr-quant`` on the same words when it imports (a benchmark dependency only:
``pip install spqr-quant``; it compiles its extension with nvcc on first import). Headline
times (``µs``, ``× dense``) are GPU time with the L2 cache flushed before each call: the call is
captured once in a CUDA graph (no Python launch overhead, as decoding runs under CUDA graphs;
it also checks that every row can be captured), and 256 MB are written then read between
replays, since an H100's 50 MB L2 would otherwise hold every 4-bit weight up to 8192². The read
leaves the L2 full of clean lines, as a layer finds it after the layers before it streamed
their weights through. ``µs dirty L2`` only writes the 256 MB (``triton.testing.do_bench``'s
flush): the L2 is then full of dirty lines, and the timed call pays for writing back as many
of them as the bytes it brings in (up to the L2's size), which weighs more on a small weight
than on a large one. ``µs L2-hot`` is
``triton.testing.do_bench_cudagraph`` replaying the same weight (``--timer do_bench``: plain
``do_bench``). lowbit's 4-bit g128 kernel also runs in bf16 on the bf16 codes and scales torch's
int4 kernel takes (``× torch int4``), and the launch configurations each kernel chose are listed
under the table. The triton backend tunes
a few launch configurations per shape on its first call: ~9 compiles of a few seconds per shape
and format, so run two shapes per command under the 10-minute limit (Triton's cache makes
reruns fast; ``LOWBIT_TRITON_TUNE=0`` skips tuning for a quick first pass)::

    python benchmarks/bench_gemv.py --device cuda --shapes 4096x4096 11008x4096 --out docs/results/kernels_gpu_1.md
    python benchmarks/bench_gemv.py --device cuda --shapes 4096x11008 14336x4096 --out docs/results/kernels_gpu_2.md
    python benchmarks/bench_gemv.py --device cuda --shapes 8192x8192 28672x8192 --out docs/results/kernels_gpu_3.md
    python benchmarks/bench_gemv.py --device cuda --formats spqr --rows 1 16 --out docs/results/spqr_gemv_gpu.md

Mixed 2/4/16 (``--mixed``, Li et al., 2024): the ``mixed-2-4-16`` format (25 % 4-bit groups, 0.2 %
fp16 outliers, RTN on the random weight) through :func:`lowbit.kernels.mixed_gemv.mixed_gemv`
at M <= 16: the asynchronous kernel (outliers fused), the synchronous one, the asynchronous one
with the outliers in a separate SpMV launch, and the asynchronous one without outliers (the
dense part alone, its bytes without the CSR); from 17 rows the ``triton`` backend's prefill
(the weight decoded by :func:`lowbit.kernels.mixed_dequant.mixed_dequant`, then cuBLAS; SpQR's
rows are its layers, prefill included); on the CPU the ``reference`` backend. Bytes are
every stored tensor the kernel reads. The paper's targets at M = 1 on every shape from 11008 x
4096 up: async >= 4.5x cuBLAS fp16, >= 1.15x sync, outliers <= 15 % (async fused against
async without outliers)::

    python benchmarks/bench_gemv.py --device cuda --mixed --rows 1 16 --formats 4:128 2:64 --shapes 4096x4096 11008x4096 --out docs/results/mixed_gemv_gpu_1.md
    python benchmarks/bench_gemv.py --device cuda --mixed --rows 1 16 --formats 4:128 2:64 --shapes 4096x11008 14336x4096 --out docs/results/mixed_gemv_gpu_2.md
    python benchmarks/bench_gemv.py --device cuda --mixed --rows 1 16 --formats 4:128 2:64 --shapes 8192x8192 28672x8192 --out docs/results/mixed_gemv_gpu_3.md

CPU (4096² and SmolLM2's layer shapes; fp32 and bf16 ``F.linear``,
``aten._weight_int4pack_mm_for_cpu`` at 4 bits g128 in bf16, and every lowbit backend that runs
on the CPU, ``reference`` and ``torch-cpu`` included, with bf16 inputs, plus W8 per channel;
times from ``torch.utils.benchmark``, the fastest of its blocks)::

    python benchmarks/bench_gemv.py --device cpu   # table in docs/results/kernels.md
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import command_line, markdown_table, stamp  # noqa: E402

GPU_SHAPES = ["4096x4096", "11008x4096", "4096x11008", "14336x4096", "8192x8192", "28672x8192"]
CPU_SHAPES = ["4096x4096", "576x1536", "1536x576", "576x576"]
FORMATS = ["8:128", "4:128", "3:128", "2:64"]  # bits:group ("8:0" = per channel)
CPU_FORMATS = [*FORMATS, "8:0"]  # 8-bit per channel: the layout torch's int8 CPU kernel takes
GPU_FORMATS = [*FORMATS, "spqr"]  # "spqr": SpQR rows (lowbit's kernels and Crnčević's)
SPQR_QUANT_FLAGS = 257  # FeatureFlags.SPARSE_FUSED_FP32 (fused sparse, fp32 accumulation)


def spqr_rows(weight, device: str, act_dtype, rows_m) -> list:
    """SpQR rows for one shape: lowbit's fused kernel (outlier layout profiled, CSR, PTCSR, and
    no outliers: what they cost) and, when the PyPI package ``spqr-quant`` imports, Crnčević's
    own CUDA kernel on the same words (its fused, permuted matvec; at M > 1 one call per row,
    as its batched path loops). Weights: SpQR without calibration with 1% outliers and a
    random input permutation (act-order's gather), as the thesis's layers have. Also checks that
    its dequantization of the words equals lowbit's (the layouts are the same)."""
    import torch

    from lowbit.algorithms.spqr import SpQRSpec
    from lowbit.nn.spqr_linear import SpQRLinear

    n, k = weight.shape
    # a tiny tau: the budget's most salient weights, without the bisection (faster at 28672 x
    # 8192; the speed does not depend on which weights are outliers, only on how many)
    q = SpQRSpec(outlier_fraction=0.01, tau=1e-12).rtn(weight)
    q.perm = torch.randperm(k, generator=torch.Generator().manual_seed(1)).to(torch.int16)
    q = q.to(device)
    w_ref = q.dequantize(torch.float32)
    backend = "triton" if device == "cuda" else "torch-cpu"
    rows = []
    for label, sparse, container in (
        ("auto", "auto", q), ("csr", "csr", q), ("ptcsr", "ptcsr", q),
        ("0% outliers", "csr", SpQRSpec(outlier_fraction=0.0).rtn(weight).to(device)),
    ):  # fmt: skip
        if label == "0% outliers":
            container.perm = q.perm
        layer = SpQRLinear.from_quantized(container, backend=backend)
        layer.set_sparse_format(sparse)
        ref = w_ref if label != "0% outliers" else container.dequantize(torch.float32)
        rows.append((f"lowbit spqr w3 1% {label}" if label != "0% outliers"
                     else "lowbit spqr w3 0% (dense only)", layer, None, ref, act_dtype,
                     None))  # fmt: skip
    if device == "cuda":
        try:
            import spqr_quant  # noqa: F401  (compiles its CUDA extension on first import)
        except Exception as err:  # a benchmark dependency only
            print(f"spqr-quant kernel skipped: spqr_quant does not import ({err})", flush=True)
            return rows
        words = q.words().reshape(-1).contiguous()  # spqr_quant's dense_weights, same layout
        row_offsets, col_vals = q.outliers.row_ptr, q.outliers.col_val
        perm16 = q.perm.to(torch.int32) & 0xFFFF
        in_perm = (perm16[0::2] | (perm16[1::2] << 16)).to(torch.int32)  # uint16 pairs
        nnz = col_vals.numel()

        def spqr_quant_mul(x):  # [M, K] fp16 -> [M, N], one matvec per row
            out = torch.empty(x.shape[0], n, dtype=torch.float16, device=x.device)
            for i in range(x.shape[0]):
                torch.ops.spqr_cuda.spqr_mul_fused(
                    n, k, 3, 16, 16, in_perm, words, row_offsets, col_vals, nnz,
                    x[i].contiguous(), SPQR_QUANT_FLAGS, out[i], out[i],
                )  # fmt: skip
            return out

        decoded = torch.zeros(n, k, dtype=torch.float16)
        torch.ops.spqr_cuda.dequantize_compressed(
            n, k, 3, 16, 16, words.cpu(), row_offsets.cpu(), col_vals.cpu(), nnz, decoded
        )  # its host decoder: the stored column order, outliers included
        same = torch.equal(decoded.float(), q.dequantize_permuted().cpu().half().float())
        print(f"{n}x{k}: spqr_quant decodes lowbit's words to the same weight: {same}", flush=True)
        nbytes = sum(t.numel() * t.element_size() for t in (words, row_offsets, col_vals, in_perm))
        rows.append(("spqr-quant CUDA w3 1%", spqr_quant_mul, nbytes, w_ref, torch.float16, None))
    return rows


def _bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def _tensors(prepared: dict) -> list:
    """The tensors a prepared layout holds (SpQR's: words, permutation, outlier buffers)."""
    out = []
    for value in prepared.values():
        if hasattr(value, "col_val"):  # an outlier container
            ptr = value.row_ptr if hasattr(value, "row_ptr") else value.tile_ptr
            out += [ptr, value.col_val]
        elif hasattr(value, "numel"):
            out.append(value)
    return out


def fused_prefill(layer, dtype):
    """``(x -> the fused prefill kernel's product at any M, bytes it reads)`` on the layer's
    prepared layout (the backend takes this kernel below ``DEQUANT_M`` rows only)."""
    from lowbit.kernels.dispatch import prepare_layer
    from lowbit.kernels.int_gemm import int_gemm

    prepare_layer(layer, dtype)
    (prepared,) = layer.__dict__["_prepared"].values()
    operands = (prepared["words"], prepared["scale"], prepared["zero"], None)
    return (lambda x: int_gemm(x, *operands, **prepared["static"])), _bytes(*_tensors(prepared))


def _fitting_group(group: int, k: int) -> int:
    """``group``, or the largest of 64 and 32 dividing ``k`` when it does not (K = 576)."""
    return next(g for g in (group, 64, 32) if k % g == 0)


def mixed_kernels(weight, device: str, act_dtype):
    """``(name, fn(x), bytes read, fp32 weight, input dtype, largest M)`` of the mixed 2/4/16
    rows (see the module doc)."""
    import torch

    from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
    from lowbit.nn.mixed_linear import MixedLinear

    q = mixed_quantize(weight, None, MixedWeightSpec()).quantized  # 25 %, 0.2 %, RTN
    full = q.dequantize(torch.float32)  # [N, K]
    sparse = q.outliers.to_dense()
    nbytes = _bytes(*q.stored_tensors().values())
    csr = _bytes(q.outliers.row_ptr, q.outliers.col_val)
    if device != "cuda":
        layer = MixedLinear.from_quantized(q, backend="reference")
        return [("lowbit mixed 2/4/16 reference", layer, nbytes, full, act_dtype, None)]
    from lowbit.kernels.mixed_gemv import mixed_gemv
    from lowbit.kernels.mixed_layout import prepare_mixed

    ops = prepare_mixed(q)
    dense_ops = dict(ops, max_row_nnz=0)
    name = "lowbit mixed 2/4/16"
    # the layer on the triton backend from 17 rows: the weight decoded (mixed_dequant), cuBLAS
    layer = MixedLinear.from_quantized(q, backend="triton")
    return [
        (f"{name} prefill (decode + cuBLAS)", layer, nbytes, full, act_dtype, None),
        (f"{name} async", lambda x: mixed_gemv(x, ops), nbytes, full, act_dtype, 16),
        (f"{name} sync", lambda x: mixed_gemv(x, ops, asynchronous=False), nbytes, full,
         act_dtype, 16),
        (f"{name} async, SpMV apart", lambda x: mixed_gemv(x, ops, fuse_outliers=False),
         nbytes, full, act_dtype, 16),
        (f"{name} async, no outliers", lambda x: mixed_gemv(x, dense_ops), nbytes - csr,
         full - sparse, act_dtype, 16),
    ]  # fmt: skip


def copy_bandwidth(device: str, timer) -> float:
    """Bytes per second of a large device-to-device copy (read + write counted)."""
    import torch

    n = (1 << 30) if device == "cuda" else (256 << 20)
    src = torch.empty(n, dtype=torch.uint8, device=device).fill_(1)
    dst = torch.empty_like(src)
    return 2 * n / timer(lambda: dst.copy_(src))


def int4_tinygemm(codes, scale, group, device):
    """torch's int4 kernel on lowbit's symmetric 4-bit codes ``[N, K]`` and scales ``[N, G]``.

    Both kernels decode ``w = (c - 8) * s + z`` per group with unsigned codes and bf16 ``(s, z)``
    ``[K / g, N, 2]``; lowbit's symmetric codes are ``z = 0``. The CUDA kernel takes
    ``[N, K / 2]`` uint8 with the even element in the high nibble (``_convert_weight_to_int4pack
    (w, innerKTiles=8)``), the CPU one ``[N, K]`` int32 codes (``_convert_weight_to_int4pack_for_cpu
    (w, 2)``). Returns ``(fn(x), bytes read)``.
    """
    import torch

    scale_zero = torch.stack((scale.float(), torch.zeros_like(scale.float())), -1)  # [N, G, 2]
    scale_zero = scale_zero.transpose(0, 1).contiguous().to(torch.bfloat16)  # [G, N, 2]
    if device == "cuda":
        packed = ((codes[:, ::2] << 4) | codes[:, 1::2]).to(torch.uint8)  # [N, K / 2]
        w = torch.ops.aten._convert_weight_to_int4pack(packed, 8)
        op = torch.ops.aten._weight_int4pack_mm
    else:
        w = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 2)
        op = torch.ops.aten._weight_int4pack_mm_for_cpu
    return (lambda x: op(x, w, group, scale_zero)), _bytes(w, scale_zero)


def cold_timer(fn, reps: int = 50, flush: str = "read") -> float:
    """Seconds of one call of ``fn`` with the L2 cache flushed before it, CUDA-graph replays
    timed by events (:func:`lowbit.kernels.triton_support.time_call`, the tuner's timer)."""
    from lowbit.kernels.triton_support import time_call

    return time_call(fn, reps, flush) * 1e-3


def chosen_configs() -> list[str]:
    """The launch configurations lowbit's kernels chose (tuned or default) so far, per key."""
    from lowbit.kernels import int_gemm, int_gemv, mixed_gemv, spqr_gemv

    lines = []
    for module in (int_gemv, int_gemm, spqr_gemv, mixed_gemv):
        for key, config in module._TUNED.items():
            shown = tuple(str(v).replace("torch.", "") for v in key)
            lines.append(f"- `{module.__name__.split('.')[-1]}` {shown}: {config}")
    return lines


def main() -> None:
    import torch
    import torch.nn.functional as F

    from lowbit.formats.intq import IntQuantized
    from lowbit.kernels import dispatch
    from lowbit.kernels.triton_int import SMALL_M
    from lowbit.kernels.triton_support import TIMINGS
    from lowbit.nn.packed_linear import PackedLinear

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--shapes", nargs="+", default=None, help="N x K, e.g. 4096x11008")
    parser.add_argument("--rows", type=int, nargs="+", default=None, help="M values")
    parser.add_argument("--formats", nargs="+", default=None, help="bits:group (0 = channel)")
    parser.add_argument("--timer", choices=["cudagraph", "do_bench"], default="cudagraph")
    parser.add_argument("--mixed", action="store_true", help="add the mixed 2/4/16 rows")
    parser.add_argument("--seconds", type=float, default=0.3, help="CPU: time per measurement")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda needs a CUDA device; --device cpu runs the CPU table")
    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes or (
        GPU_SHAPES if device == "cuda" else CPU_SHAPES)]  # fmt: skip
    rows_m = args.rows or [1, 4, 16, 2048]
    formats = args.formats or (GPU_FORMATS if device == "cuda" else CPU_FORMATS)
    with_spqr = "spqr" in formats
    formats = [tuple(int(v) for v in f.split(":")) for f in formats if f != "spqr"]
    load_before = os.getloadavg()[0]

    if device == "cuda":
        import triton.testing

        # a row that cannot be captured is a finding, not a row to time another way
        warnings.filterwarnings("error", message="timed without a CUDA graph")

        bench = (
            triton.testing.do_bench_cudagraph
            if args.timer == "cudagraph"
            else triton.testing.do_bench
        )

        def timer(fn):  # seconds, L2-hot (the same weight replayed)
            return bench(fn) * 1e-3

        headline_timer = cold_timer  # L2 flushed before each timed call (left clean)

        def dirty_timer(fn):  # L2 flushed by writing (left dirty), the earlier tables' headline
            return cold_timer(fn, flush="write")

        dense_dtype, act_dtype, backends = torch.float16, torch.float16, ["triton"]
        dense_name = "cuBLAS fp16"
    else:
        from torch.utils.benchmark import Timer

        def timer(fn):  # the fastest block: other jobs on a shared machine only add time
            t = Timer("fn()", globals={"fn": fn}, num_threads=args.threads)
            return min(t.blocked_autorange(min_run_time=args.seconds).times)

        headline_timer = dirty_timer = None  # one timer on the CPU

        dense_dtype, act_dtype = torch.float32, torch.bfloat16
        dense_name = "F.linear fp32"
        backends = [b for b in dispatch.backend_names() if b not in ("auto", "triton")]

    copy_bw = copy_bandwidth(device, timer)
    print(f"copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    header = ["N x K", "M", "kernel", "µs", "µs dirty L2", "µs L2-hot", "weight GB/s", "% of copy", "GFLOP/s",
              "× dense", "× torch int4", "err"]  # fmt: skip
    table, timed = [], []  # rows; each tuning's candidates and times

    for n, k in shapes:
        weight = torch.randn(n, k, device=device) * 0.02  # [N, K] fp32
        # (name, fn(x), bytes read, fp32 weight it stands for, input dtype, largest M or None),
        # built once per shape
        kernels = []
        dense = weight.to(dense_dtype)
        kernels.append((dense_name, lambda x, w=dense: F.linear(x, w), _bytes(dense), dense.float(),
                        dense_dtype, None))  # fmt: skip
        if device == "cpu":
            bf = weight.to(torch.bfloat16)
            kernels.append(("F.linear bf16", lambda x, w=bf: F.linear(x, w), _bytes(bf),
                            bf.float(), torch.bfloat16, None))  # fmt: skip
        g4 = _fitting_group(128, k)
        # scales exact in bf16, as the int4 kernel keeps them
        q4 = IntQuantized.from_float(weight, 4, group_size=g4, scale_dtype=torch.bfloat16)
        codes = (q4.codes().view(n, k).to(torch.int16) + 8).to(torch.uint8)  # [N, K]
        fn, nbytes = int4_tinygemm(codes, q4.scale, g4, device)
        int4_name = f"torch int4 g{g4} bf16"
        kernels.append((int4_name, fn, nbytes, q4.dequantize(torch.float32),
                        torch.bfloat16, None))  # fmt: skip
        if device == "cuda":  # bf16 beside bf16: the same codes and bf16 scales on lowbit's kernels
            layer = PackedLinear.from_quantized(q4, backend="triton")
            kernels.append((f"lowbit triton W4 g{g4} bf16", layer, None,
                            q4.dequantize(torch.float32), torch.bfloat16, None))  # fmt: skip
        del q4, codes
        for bits, group in formats:
            group = _fitting_group(group, k) if group else None
            q = IntQuantized.from_float(weight, bits, group_size=group, scale_dtype=torch.float16)
            for backend in backends:
                layer = PackedLinear.from_quantized(q, backend=backend)
                probe = torch.zeros(1, k, device=device, dtype=act_dtype)
                if dispatch.get_backend(backend).unsupported(layer, probe) is not None:
                    continue
                name = f"lowbit {backend} W{bits} " + (f"g{group}" if group else "pc")
                kernels.append((name, layer, None, q.dequantize(torch.float32), act_dtype, None))
                if backend == "triton":  # the fused prefill kernel, which from DEQUANT_M rows
                    # gives way to the decoded weight and cuBLAS: both side by side
                    kernels.append((f"{name} fused prefill", *fused_prefill(layer, act_dtype),
                                    q.dequantize(torch.float32), act_dtype, None))  # fmt: skip
        if with_spqr:
            spqr_act = torch.float16 if device == "cuda" else act_dtype
            kernels.extend(spqr_rows(weight, device, spqr_act, rows_m))
        if args.mixed and k % 16 == 0:
            kernels += mixed_kernels(weight, device, act_dtype)

        for m in rows_m:
            x32 = torch.randn(m, k, device=device)  # [M, K]
            t_dense = t_int4 = None
            for name, fn, nbytes, w_ref, dtype, max_m in kernels:
                if max_m is not None and m > max_m:
                    continue
                if ("fused prefill" in name or "(decode + cuBLAS)" in name) and m <= SMALL_M:
                    continue  # prefill paths, timed from 17 rows
                x = x32.to(dtype)
                y_ref = x.float() @ w_ref.t()  # [M, N] fp32: same weight, same input
                with torch.no_grad():
                    y = fn(x).float()  # prepares (and on the GPU tunes) outside the timing
                if TIMINGS:  # the candidates that call tuned, L2-hot do_bench times
                    timed.append(f"- {n}x{k} M={m} {name}: " + ", ".join(
                        f"{config} {ms * 1e3:.1f} µs" for config, ms in TIMINGS))  # fmt: skip
                    TIMINGS.clear()
                with torch.no_grad():
                    hot = timer(lambda fn=fn, x=x: fn(x))
                    seconds = headline_timer(lambda fn=fn, x=x: fn(x)) if headline_timer else hot
                    dirty = dirty_timer(lambda fn=fn, x=x: fn(x)) if dirty_timer else None
                if nbytes is None and fn.backend == "triton":  # what the kernels read
                    (prepared,) = fn.__dict__["_prepared"].values()
                    nbytes = _bytes(*_tensors(prepared))
                elif nbytes is None:  # the canonical packed storage
                    nbytes = fn.memory_bytes()
                err = float((y - y_ref).abs().max() / y_ref.abs().max())
                t_dense = t_dense or seconds
                if name == int4_name:
                    t_int4 = seconds
                vs_int4 = f"{t_int4 / seconds:.2f}" if t_int4 and dtype == torch.bfloat16 else "-"
                bw = nbytes / seconds
                table.append([
                    f"{n}x{k}", m, name, f"{seconds * 1e6:.1f}",
                    f"{dirty * 1e6:.1f}" if dirty else "-",
                    f"{hot * 1e6:.1f}" if headline_timer else "-", f"{bw / 1e9:.1f}",
                    f"{100 * bw / copy_bw:.0f}%", f"{2 * m * n * k / seconds / 1e9:.0f}",
                    f"{t_dense / seconds:.2f}", vs_int4, f"{err:.1e}",
                ])  # fmt: skip
                print(" | ".join(map(str, table[-1])), flush=True)
        for line in chosen_configs():
            print(line, flush=True)

    load_after = os.getloadavg()[0]
    dense_note = "fp16 cuBLAS" if device == "cuda" else "fp32 F.linear"
    text = (
        f"{stamp(command_line())} Copy bandwidth {copy_bw / 1e9:.1f} GB/s (device-to-device, "
        f"read + write). Load average (1 min) {load_before:.2f} before, {load_after:.2f} after. "
        f"× dense = time of {dense_note} / time; × torch int4 = its time / time, bf16 rows. "
        + (
            "µs: L2 flushed before each call (256 MB written then read between CUDA-graph "
            "replays: clean lines); µs dirty L2: 256 MB written only (dirty lines, written back "
            "during the call); µs L2-hot: the same weight replayed (do_bench_cudagraph)."
            if headline_timer
            else ""
        )
        + f"\n\n{markdown_table(header, table)}\n"
        + "\nLaunch configurations chosen:\n\n"
        + "\n".join(chosen_configs())
        + ("\n\nCandidates each tuning timed:\n\n" + "\n".join(timed) if timed else "")
        + "\n"
    )
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
