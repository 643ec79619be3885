"""First contact with a GPU: compile and launch every Triton kernel of lowbit once, with tuning
off, check each product against its torch reference, and print the compiled kernel's resources
as the driver loaded it (registers, shared memory, spills, blocks per SM, SPLIT_K the grid took).

Meant as the first stage of ``tools/gpu_session.sh`` (about two minutes, most of it compiles):
a kernel that does not launch or computes something else is found before any benchmark. Exits
non-zero when any product is off its reference. ::

    LOWBIT_TRITON_TUNE=0 python tools/gpu_smoke.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("LOWBIT_TRITON_TUNE", "0")

# |kernel - reference| <= TOL * max|reference| (the interpreter tests' bounds)
TOL = {"float16": 2e-3, "bfloat16": 1.6e-2}


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


def _mixed_down_projection(device: str, n: int, gen):
    """The 2/4/16 kernel on the down projection's shape with fused outliers (0.2 %, rows of up to
    64): the layer whose every M = 1 candidate the tuner refused on the first H200 run. First in
    the smoke stage, so that a stage cut by its time limit still answers it."""
    import torch

    from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
    from lowbit.errors import LowbitError
    from lowbit.kernels import mixed_gemv
    from lowbit.kernels.mixed_layout import mixed_reference, prepare_mixed

    wide = torch.randn(n, 11008, generator=gen) * 0.02
    spec = MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.002, g2=8)
    q = mixed_quantize(wide, None, spec).quantized.to(device)
    ops = prepare_mixed(q)
    x = torch.randn(1, 11008, generator=gen).to(device, torch.float16)
    name = f"mixed 2/4/16 0.2% outliers M=1 {n}x11008"
    try:
        config = mixed_gemv._choose(x, ops, None, True, True, tune=False)
    except LowbitError as refusal:
        yield name, str(refusal), None, float("inf"), torch.float16
        return
    got = mixed_gemv._launch(x, ops, None, config, True, True)
    compiled = mixed_gemv._launch(x, ops, None, config, True, True, probe=True)
    yield name, config, compiled, _rel_err(got, mixed_reference(x, q)), torch.float16


def _int_tile_loop_rows(name: str, args, n_tiles: int):
    """The M = 1 tuning candidates whose tile loop no default launch exercises, each launched
    once: ``stages`` 2 (the next tile's words loaded into registers while one decodes: a branch
    per tile and a store that never runs) and above 2 (the words copied into shared memory
    ahead of their use, by TMA from sm_90, with activations loaded by inline PTX)."""
    import torch

    from lowbit.kernels import int_gemv
    from lowbit.kernels.int_layout import tiled_reference

    for shape in int_gemv._candidates(1, args[5]):
        if shape[4] == 1:
            continue
        label = f"{name} {shape[1]} rows {shape[2]} warps stages {shape[4]}"
        config = int_gemv._config(args, shape, n_tiles)
        if isinstance(config, str):  # cannot launch here: the reason stands in the config
            yield label, config, None, float("inf"), torch.float16
            continue
        got = int_gemv._launch(*args, config)
        compiled = int_gemv._launch(*args, config, probe=True)
        yield label, config, compiled, _rel_err(got, tiled_reference(*args)), torch.float16


def smoke_rows(device: str = "cuda", n: int = 4096, k: int = 4096, prefill_rows: int = 512):
    """``(name, config, compiled kernel or None, relative error, dtype)`` of one launch of each
    kernel on an ``n x k`` weight with its default configuration (the compiled kernel is None
    under Triton's interpreter, or when no configuration could launch: then ``config`` says
    why)."""
    import torch

    from lowbit.algorithms.mixed import MixedWeightSpec, mixed_quantize
    from lowbit.algorithms.spqr import SpQRSpec
    from lowbit.formats.intq import IntQuantized
    from lowbit.kernels import int_gemm, int_gemv, mixed_gemv, spqr_gemv
    from lowbit.kernels.int_dequant import int_dequant
    from lowbit.kernels.int_layout import tiled_reference
    from lowbit.kernels.mixed_dequant import mixed_dequant
    from lowbit.kernels.mixed_layout import mixed_reference, prepare_mixed
    from lowbit.nn.packed_linear import PackedLinear

    gen = torch.Generator().manual_seed(0)
    yield from _mixed_down_projection(device, n, gen)
    weight = torch.randn(n, k, generator=gen) * 0.02
    bias = (torch.randn(n, generator=gen) * 0.02).to(device)
    # (8 bits: the 16-row kernel's fp16 pairs of codes from two bytes of a word)
    formats = ((4, 128, True), (4, 128, False), (3, 128, True), (2, 64, False), (8, 128, True))
    for bits, group, symmetric in formats:
        q = IntQuantized.from_float(weight, bits, group_size=group, symmetric=symmetric,
                                    scale_dtype=torch.float16)  # fmt: skip
        layer = PackedLinear.from_quantized(q, backend="triton").to(device)
        for dtype in (torch.float16, torch.bfloat16):
            for m in (1, 16, prefill_rows):
                x = torch.randn(m, k, generator=gen).to(device, dtype)
                layer(x)  # prepares the layout
                (prepared,) = layer.__dict__["_prepared"].values()
                static = prepared["static"]
                args = (x, prepared["words"], prepared["scale"], prepared["zero"], bias.to(dtype),
                        bits, static["group_size"], static["tile"])  # fmt: skip
                if m <= 16:  # the default block shape, SPLIT_K from its occupancy
                    module = int_gemv
                    n_tiles = prepared["words"].shape[1] // static["tile"]
                    config = int_gemv._choose(args, m, n_tiles, tune=False)
                else:
                    module, config = int_gemm, next(int_gemm._candidates())
                got = module._launch(*args, config)
                compiled = module._launch(*args, config, probe=True)
                sym = "sym" if symmetric else "asym"
                name = f"int W{bits} g{group} {sym} M={m} {str(dtype)[6:]}"
                yield name, config, compiled, _rel_err(got, tiled_reference(*args)), dtype
                if m == 1 and bits == 4 and dtype == torch.float16:
                    yield from _int_tile_loop_rows(name, args, n_tiles)
            # the prefill's weight decoder (the backend's path from DEQUANT_M rows)
            decode = dict(k=k, dtype=dtype, bits=bits, group_size=static["group_size"],
                          tile=static["tile"])  # fmt: skip
            got = int_dequant(*args[1:4], **decode)
            err = _rel_err(got, q.dequantize(dtype).to(device))
            yield (f"int W{bits} g{group} {sym} weight decoder {str(dtype)[6:]}", "-",
                   int_dequant(*args[1:4], **decode, probe=True), err, dtype)  # fmt: skip

    spqr = SpQRSpec(outlier_fraction=0.01, tau=1e-12).rtn(weight)
    spqr.perm = torch.randperm(k, generator=gen).to(torch.int16)
    spqr = spqr.to(device)
    words, perm = spqr.words(), (spqr.perm.to(torch.int32) & 0xFFFF)
    sparse = spqr_gemv.sparse_operands(spqr.outliers)
    # M = 1 in both dtypes: their GEMVs scale the subnormal codes' x differently
    for m, dtype in ((1, torch.float16), (1, torch.bfloat16), (16, torch.float16)):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        args = (x, words, perm, sparse, bias.to(dtype), n)
        config = spqr_gemv._choose(args, m, words.shape[1] // 16)
        got = spqr_gemv._launch(*args, config)
        compiled = spqr_gemv._launch(*args, config, probe=True)
        err = _rel_err(got, spqr_gemv.spqr_reference(x, spqr, bias.to(dtype)))
        yield f"spqr w3 1% M={m} {str(dtype)[6:]}", config, compiled, err, dtype
    dense = spqr_gemv.spqr_dequantize_dense(words, n, k)
    err = _rel_err(dense, spqr_gemv.words_dense_reference(words, n, k))
    compiled = spqr_gemv.spqr_dequantize_dense(words, n, k, probe=True)
    yield "spqr w3 weight decoder", "-", compiled, err, torch.float16

    q = mixed_quantize(weight, None, MixedWeightSpec()).quantized.to(device)
    ops = prepare_mixed(q)
    for m, dtype in ((1, torch.float16), (1, torch.bfloat16), (16, torch.float16)):
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        b = bias.to(dtype)
        config = mixed_gemv._choose(x, ops, b, True, True, tune=False)
        got = mixed_gemv._launch(x, ops, b, config, True, True)
        compiled = mixed_gemv._launch(x, ops, b, config, True, True, probe=True)
        err = _rel_err(got, mixed_reference(x, q, b))
        yield f"mixed 2/4/16 M={m} {str(dtype)[6:]}", config, compiled, err, dtype
    err = _rel_err(mixed_dequant(ops, torch.float16), q.dequantize(torch.float16))
    compiled = mixed_dequant(ops, torch.float16, probe=True)
    yield "mixed 2/4/16 weight decoder", "-", compiled, err, torch.float16


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu_smoke needs a CUDA device", file=sys.stderr)
        return 2
    import triton

    from lowbit.kernels.triton_support import (
        blocks_per_sm,
        device_limits,
        launch_refusal,
        resources_of,
    )

    props = torch.cuda.get_device_properties(0)
    print(f"{props.name}, {props.multi_processor_count} SMs, torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}", flush=True)  # fmt: skip
    print("| kernel | config | registers | shared bytes | spill bytes | blocks/SM | launches | "
          "err | check |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|", flush=True)
    limits = device_limits(torch.device("cuda"))
    all_ok = True
    for name, config, compiled, err, dtype in smoke_rows():
        if compiled is None:  # refused before launching: the reason stands in the config
            all_ok = False
            print(f"| {name} | {config} | | | | | no | | FAIL |", flush=True)
            continue
        res = resources_of(compiled)
        ok = err <= TOL[str(dtype).removeprefix("torch.")]
        all_ok &= ok
        print(f"| {name} | {config} | {res.registers} | {res.shared} | {res.spill} | "
              f"{blocks_per_sm(res, limits)} | {launch_refusal(res, limits) or 'yes'} | "
              f"{err:.1e} | {'ok' if ok else 'FAIL'} |", flush=True)  # fmt: skip
    torch.cuda.synchronize()
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
