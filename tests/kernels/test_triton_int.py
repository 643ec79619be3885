"""The triton backend's kernels against their torch reference and the reference backend.

Without CUDA the kernels run under ``TRITON_INTERPRET=1`` (set by ``tests/conftest.py`` before
anything imports Triton: the interpreter is chosen for the whole process) on small irregular
shapes: N = 37 and K = 96/160 are not multiples of any block, M = 1, 3, 13 take the decode kernel
(the GEMV path at M = 1, the tl.dot path above) and M = 33 the prefill kernel. With CUDA the
same tests run compiled on the GPU, and the ``gpu`` ones add real layer sizes.
"""

import pytest
import torch

triton = pytest.importorskip("triton")

from lowbit.api import quantize  # noqa: E402
from lowbit.errors import LowbitError  # noqa: E402
from lowbit.formats.intq import IntQuantized  # noqa: E402
from lowbit.kernels import dispatch, triton_int, triton_support  # noqa: E402
from lowbit.kernels.int_dequant import int_dequant  # noqa: E402
from lowbit.kernels.int_gemm import int_gemm  # noqa: E402
from lowbit.kernels.int_gemv import int_gemv  # noqa: E402
from lowbit.kernels.int_layout import tile_words, tiled_reference  # noqa: E402
from lowbit.models.tiny import tiny_model  # noqa: E402
from lowbit.nn.packed_linear import PackedLinear, set_backend  # noqa: E402
from lowbit.recipes.registry import get_recipe  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRET else "cuda"
pytestmark = pytest.mark.interpreter

N = 37
ROWS = (1, 3, 13, 33)  # GEMV, small batch (tl.dot, rows masked), prefill
DTYPES = [torch.float16, torch.bfloat16]

# |kernel - reference| <= TOL * max|reference|, for both references: the reference backend
# (rounds each weight to x's dtype, then its product's output) and the kernels' torch reference
# (fp32 decode, fp32 matmul, one rounding). The decode kernel keeps the fp32 weight, the prefill
# kernel rounds it to x's dtype as the reference backend does; both accumulate in fp32 and round
# the output once. Measured over FORMATS x ROWS (interpreter), vs the reference backend: fp16
# 7.6e-4, bf16 7.1e-3; vs the torch reference: decode fp16 2.4e-4, bf16 0 (the same sums),
# prefill fp16 8.9e-4, bf16 7.2e-3 (its bf16 weights). With the zero points applied once per
# group at M = 1 (s * (sum code * x - z * sum x)), decode vs the torch reference, seed-0
# inputs: M = 1 fp16 0, bf16 1.9e-5; M = 3, 13 fp16 2.9e-5, bf16 1.4e-5.
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (bits, group, symmetric, K): every width, sym/asym, groups of 32 (K = 160: five groups, the
# last tile partial) and per channel (K = 96), plus 64-groups and 16-groups (16-word tiles);
# and the groups whose scales (and zeros) a tile loads before it decodes: two groups a tile
# (128 in 32-word 4-bit tiles, 64 in 16-word ones), one (128 in 16-word tiles, 8-bit 128 in
# 32-word ones), and one every other tile (512 in 32-word 4-bit tiles)
FORMATS = [
    *[(b, 32, sym, 160) for b in (2, 3, 4, 8) for sym in (True, False)],
    *[(b, None, sym, 96) for b in (2, 3, 4, 8) for sym in (True, False)],
    (4, 64, False, 128),
    (8, 16, True, 96),
    (3, 16, False, 160),
    (4, 128, True, 512),
    (4, 128, False, 640),
    (8, 128, False, 256),
    (4, 512, False, 1024),
]


def _layers(bits, group, symmetric, k, bias=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight, b = torch.randn(N, k, generator=gen), torch.randn(N, generator=gen)
    q = IntQuantized.from_float(
        weight, bits, group_size=group, symmetric=symmetric, scale_dtype=torch.float16
    )
    b = b if bias else None
    fast = PackedLinear.from_quantized(q, b, backend="triton").to(DEVICE)
    return fast, PackedLinear.from_quantized(q, b, backend="reference").to(DEVICE)


def _operands(layer):
    """The prepared tensors and static arguments the kernels take for ``layer``."""
    (prepared,) = layer.__dict__["_prepared"].values()
    group = None if layer.group_size in (None, layer.in_features) else layer.group_size
    tensors = (prepared["words"], prepared["scale"], prepared.get("zero"))
    return tensors, dict(
        bits=layer.bits, group_size=group, tile=tile_words(layer.in_features, layer.bits, group)
    )


def _rel_err(got, want):
    return float((got.float() - want.float()).abs().max() / want.float().abs().max())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits, group, symmetric, k", FORMATS)
def test_kernels_match_their_reference_and_the_reference_backend(bits, group, symmetric, k, dtype):
    fast, reference = _layers(bits, group, symmetric, k)
    for m in ROWS:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEVICE, dtype)
        got = fast(x)  # [M, N]: through the dispatch, prepared once, then a kernel
        assert got.shape == (m, N) and got.dtype == dtype
        assert _rel_err(got, reference(x)) <= TOL[dtype], m
        tensors, static = _operands(fast)
        want = tiled_reference(x, *tensors, fast.bias.to(dtype), **static)  # [M, N]
        assert _rel_err(got, want) <= TOL[dtype], m


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits, group, symmetric, k", [(4, 32, False, 96), (3, None, True, 160)])
def test_kernels_decode_each_weight_exactly(bits, group, symmetric, k, dtype):
    """Rows of the identity pick single weights: every kernel path returns the reference's
    weight in x's dtype bit for bit (one product, no sum to reorder)."""
    fast, reference = _layers(bits, group, symmetric, k, bias=False)
    eye = torch.eye(k, device=DEVICE, dtype=dtype)  # [K, K]
    want = reference.dequantize_weight(dtype).t()  # [K, N]
    fast(eye[:1])  # prepares the layout
    tensors, static = _operands(fast)
    assert torch.equal(int_gemm(eye, *tensors, None, **static), want)  # prefill
    assert torch.equal(int_gemv(eye[5:6], *tensors, None, **static), want[5:6])  # GEMV
    assert torch.equal(int_gemv(eye[16:32], *tensors, None, **static), want[16:32])  # tl.dot


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits, group, symmetric, k", FORMATS)
def test_the_decoded_prefill_weight_is_the_reference_weight_bit_for_bit(
    bits, group, symmetric, k, dtype
):
    """From DEQUANT_M rows the backend decodes the weight and calls F.linear: the weight is the
    reference backend's, so the product is too, bit for bit."""
    fast, reference = _layers(bits, group, symmetric, k)
    x = torch.randn(triton_int.DEQUANT_M, k, generator=torch.Generator().manual_seed(1))
    x = x.to(DEVICE, dtype)  # [DEQUANT_M, K]
    assert torch.equal(fast(x), reference(x))
    tensors, static = _operands(fast)
    weight = int_dequant(*tensors, k=k, dtype=dtype, **static, block_n=16)  # [N, K], 3 blocks
    assert torch.equal(weight, reference.dequantize_weight(dtype))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # 65504 * w: inf in both
@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
@pytest.mark.parametrize("k", [128, 160], ids=["even-k", "masked-k"])
def test_fp16_gemv_is_exact_at_the_ends_of_the_fp16_range(symmetric, k):
    """The fp16 GEMV (M = 1) multiplies codes as subnormal floats by x * 2**(100 - s): one-hot
    inputs at the smallest subnormal (2**-24) and the largest fp16 (65504) give the torch
    reference's output bit for bit (no product leaves the normal fp32 range). K = 128 is a
    whole tile (unmasked x loads), K = 160 is not."""
    fast, _ = _layers(4, 32, symmetric, k, bias=False)
    tensors, static = None, None
    for value in (2.0**-24, 65504.0):
        for col in (0, 37, k - 1):
            x = torch.zeros(1, k, dtype=torch.float16, device=DEVICE)
            x[0, col] = value
            if tensors is None:
                fast(x)  # prepares the layout
                tensors, static = _operands(fast)
            want = tiled_reference(x, *tensors, None, **static)
            assert torch.equal(int_gemv(x, *tensors, None, **static), want), (value, col)


@pytest.mark.parametrize("symmetric", [True, False], ids=["sym", "asym"])
def test_bf16_gemv_is_exact_across_the_range_it_takes(symmetric):
    """The bf16 GEMV (M = 1) multiplies codes as subnormal floats by x * 2**(64 - s): one-hot
    inputs from 2**-20 to just below 2**64 give the torch reference's output bit for bit (every
    product and scaled sum a normal fp32 float)."""
    k = 160
    fast, _ = _layers(4, 32, symmetric, k, bias=False)
    fast(torch.zeros(1, k, dtype=torch.bfloat16, device=DEVICE))  # prepares the layout
    tensors, static = _operands(fast)
    for value in (2.0**-20, -0.375, 3.0 * 2.0**40, (2.0 - 2.0**-7) * 2.0**63):
        for col in (0, 37, k - 1):
            x = torch.zeros(1, k, dtype=torch.bfloat16, device=DEVICE)
            x[0, col] = value
            want = tiled_reference(x, *tensors, None, **static)
            assert torch.equal(int_gemv(x, *tensors, None, **static), want), (value, col)


@pytest.mark.parametrize(
    "m, config",
    [
        (1, (1, 16, 2, 4, 1)),
        (1, (16, 32, 2, 4, 1)),
        (5, (16, 32, 2, 4, 1)),
        (13, (16, 16, 3, 2, 1)),
    ],
    ids=["gemv-split2", "dot-m1-split2", "dot-split2", "dot-split3"],
)
def test_decode_kernel_configs_split_k_and_the_dot_path(m, config):
    """Forced launch configurations: split-K partial sums (the last split's tiles past K masked),
    the tl.dot path at M = 1, several N blocks. 8 bits, K = 160, 16-word tiles: 3 tiles."""
    fast, reference = _layers(8, 16, False, 160)
    x = torch.randn(m, 160, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.float16)
    want = fast(x)  # default configuration; prepares the layout
    tensors, static = _operands(fast)
    assert static["tile"] == 16 and tensors[0].shape[1] == 48
    got = int_gemv(x, *tensors, fast.bias.half(), **static, config=config)
    assert _rel_err(got, want) <= TOL[torch.float16]
    assert _rel_err(got, reference(x)) <= TOL[torch.float16]


def test_prefill_kernel_with_small_blocks_covers_every_output_tile():
    """BLOCK_M = BLOCK_N = 16 on 40 x 37 outputs: 3 x 3 programs in grouped order, partial
    tiles on both edges."""
    fast, reference = _layers(4, 32, True, 160)
    x = torch.randn(40, 160, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    want = reference(x)
    fast(x[:1])  # prepare
    tensors, static = _operands(fast)
    got = int_gemm(x, *tensors, fast.bias.bfloat16(), **static, config=(16, 16, 4, 2))
    assert _rel_err(got, want) <= TOL[torch.bfloat16]


def test_batched_input_without_bias_keeps_its_leading_shape():
    fast, reference = _layers(3, 32, True, 160, bias=False)
    x = torch.randn(2, 3, 160, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    got = fast(x)  # M = 6
    assert got.shape == (2, 3, N)
    assert _rel_err(got, reference(x)) <= TOL[torch.float16]


def test_a_bf16_model_runs_on_the_kernels_like_the_reference():
    """A whole tiny llama in bf16, W4 g32 asymmetric packed, prompt (M = 10) and one-token
    steps: logits within bf16 reach of the reference backend."""
    model = tiny_model("llama").to(torch.bfloat16)
    recipe = get_recipe("rtn").with_settings(w_bits=4, w_group=32, w_symmetric=False)
    quantize(model, recipe, progress=False, packed=True)
    model.to(DEVICE)
    ids = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(0)).to(DEVICE)
    with torch.no_grad():
        set_backend(model, "reference")
        want = model(ids).logits.float()
        set_backend(model, "triton")
        got = model(ids).logits.float()
    # measured max 0.0037 of max|logit|: bf16 roundings of the two products
    assert (got - want).abs().max() <= 0.02 * want.abs().max()


def test_the_backend_says_why_it_cannot_run_a_layer(monkeypatch):
    from lowbit.kernels import triton_support

    backend = dispatch.get_backend("triton")
    fast, _ = _layers(4, 32, True, 96)
    x = torch.randn(2, 96, device=DEVICE)
    assert "fp16 or bf16" in backend.unsupported(fast, x)
    odd, _ = _layers(5, 32, True, 96)
    assert "2, 3, 4 or 8-bit" in backend.unsupported(odd, x.half())
    eights, _ = _layers(4, 8, True, 96)
    assert "multiple of 16" in backend.unsupported(eights, x.half())
    assert backend.unsupported(fast, x.half()) is None
    monkeypatch.setattr(triton_support, "interpreting", lambda: False)
    assert "CUDA" in backend.unsupported(fast, torch.randn(2, 96).half())
    monkeypatch.setattr(triton_support, "triton", None)
    assert "not installed" in backend.unsupported(fast, x.half())
    with pytest.raises(LowbitError, match="cannot run this layer"):
        fast(x.half())


def test_auto_prefers_triton_on_cuda_and_never_on_the_cpu():
    assert dispatch.AUTO_ORDER["cuda"][0] == "triton"
    assert "triton" not in dispatch.AUTO_ORDER["cpu"]


def test_the_wrappers_refuse_bad_calls_in_a_sentence():
    fast, _ = _layers(4, 32, True, 96)
    x = torch.randn(17, 96, device=DEVICE, dtype=torch.float16)
    fast(x)
    tensors, static = _operands(fast)
    with pytest.raises(LowbitError, match="1 to 16 rows"):
        int_gemv(x, *tensors, None, **static)
    with pytest.raises(LowbitError, match="BLOCK_M"):
        int_gemv(x[:3], *tensors, None, **static, config=(1, 32, 1, 4, 1))
    with pytest.raises(LowbitError, match="num_warps, stages"):
        int_gemv(x[:1], *tensors, None, **static, config=(1, 32, 1, 4))
    with pytest.raises(LowbitError, match="fp16 or bf16"):
        int_gemm(x.float(), *tensors, None, **static)
    with pytest.raises(LowbitError, match="words must be"):
        int_gemm(x, tensors[0][:, :8], *tensors[1:], None, **static)
    with pytest.raises(LowbitError, match="scale must be"):
        int_gemm(x[:, :64], *tensors, None, **static)


@pytest.mark.parametrize(
    "bits, symmetric, group", [(4, True, 32), (3, False, 32), (2, False, 32), (4, False, 128)]
)
def test_the_pipelined_tile_loop_computes_the_unpipelined_product(bits, symmetric, group):
    """STAGES > 1 (2, 3 and 4, each against one unpipelined launch) only changes when the tile loop's words are loaded (2: the next tile's into
    registers, two tiles a step; 3 and 4: copied into shared memory, by TMA descriptors, which
    the interpreter emulates, 37 rows in blocks of 32: the second block's rows past N read as
    zeros); the sums, their order and so the outputs are the same bit for bit. K = 800 in groups of 32: 7 tiles at 4 bits, 5 at 3,
    4 at 2; over 2 splits (the last one short) and over 1 (two tiles a step: an odd count
    rounds up to a step past the last tile, which adds nothing). K = 768: whole tiles (3 at 4
    bits), whose last split runs past the last one (x masked by tile or the step skipped).
    Groups of 128 (zeros and scales loaded as a tile starts): K = 768 in three 32-word tiles
    of two groups each, K = 640 in five 16-word tiles of one."""
    for k in (800, 768) if group == 32 else (768, 640):
        _check_pipelined_product(bits, symmetric, k, group)


def _check_pipelined_product(bits, symmetric, k, group):
    fast, _ = _layers(bits, group, symmetric, k)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(5)).to(DEVICE, torch.float16)
    fast(x[:1])  # prepares the layout
    tensors, static = _operands(fast)
    bias = fast.bias.half()
    for m, block_m in ((1, 1), (5, 16)):
        for split in (1, 2):
            plain = int_gemv(x[:m], *tensors, bias, **static, config=(block_m, 32, split, 4, 1))
            want = tiled_reference(x[:m], *tensors, bias, **static)
            assert _rel_err(plain, want) <= TOL[torch.float16], (k, m, split)
            for stages in (2, 3, 4):
                piped = int_gemv(x[:m], *tensors, bias, **static,
                                 config=(block_m, 32, split, 4, stages))  # fmt: skip
                assert torch.equal(plain, piped), (k, m, split, stages)


def test_a_pipelined_launch_takes_tma_only_where_its_descriptor_fits():
    """A TMA descriptor needs 16-byte aligned rows: words whose rows are not (a view of a wider
    buffer) are read through pointers, to the same product bit for bit."""
    from lowbit.kernels.int_gemv import uses_tma

    fast, _ = _layers(4, 32, True, 800)
    x = torch.randn(1, 800, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.float16)
    fast(x)  # prepares the layout
    (words, *rest), static = _operands(fast)
    wide = torch.zeros(words.shape[0], words.shape[1] + 1, dtype=words.dtype, device=DEVICE)
    unaligned = wide[:, : words.shape[1]].copy_(words)  # rows 4 * (W + 1) bytes apart
    config = (1, 32, 2, 4, 3)
    assert uses_tma(words, config, x.device) and not uses_tma(unaligned, config, x.device)
    assert not uses_tma(words, (1, 32, 2, 4, 2), x.device)
    plain = int_gemv(x, words, *rest, None, **static, config=(1, 32, 2, 4, 1))
    assert torch.equal(int_gemv(x, words, *rest, None, **static, config=config), plain)
    assert torch.equal(int_gemv(x, unaligned, *rest, None, **static, config=config), plain)


def test_tuning_keeps_the_fastest_candidate_that_launches_and_computes_the_product(monkeypatch):
    """The GPU-only tuning path with fake resources and a fake timer: SPLIT_K fills one wave of
    the programs the compiled kernel keeps resident, a shape that cannot launch is never tried,
    a fast candidate with a wrong product is dropped, the fastest valid one is kept per shape."""

    from lowbit.kernels import int_gemv as gemv_module

    fast, _ = _layers(8, 16, True, 160)  # 16-word tiles: 3 tiles
    x = torch.randn(1, 160, dtype=torch.float16, device=DEVICE)
    fast(x)  # prepares the layout
    tensors, static = _operands(fast)
    want = gemv_module.int_gemv(x, *tensors, None, **static)
    shapes = list(gemv_module._candidates(1))
    assert shapes[0] == (1, 128, 4, 1, 1) and all(s[0] in (1, 16) for s in shapes)
    # shape 1 cannot launch; shape 2 is fastest but wrong; shape 3 beats the default; the
    # shapes after them (the 8-warp 16-row tile, the pipelined ones) cannot launch either
    resident = {shapes[0]: 264, shapes[1]: "it spills", shapes[2]: 132, shapes[3]: 132}
    resident.update({s: "it needs more shared memory" for s in shapes[4:]})
    assert shapes[4:] and all(s[4] > 1 or s[2] == 8 for s in shapes[4:])
    monkeypatch.setattr(gemv_module, "resident_programs",
                        lambda probe, device: resident[current[0]])  # fmt: skip
    current = [None]
    real_config = gemv_module._config

    def config(args, shape, n_tiles):
        current[0] = shape
        return real_config(args, shape, n_tiles)

    launched = []

    def launch(*args, probe=False):
        config = args[-1]
        launched.append(config)
        return want * (2 if config[:2] == shapes[2][:2] else 1)

    times = {shapes[0][:2]: 3.0, shapes[2][:2]: 1.0, shapes[3][:2]: 2.0}
    monkeypatch.setattr(triton_support, "time_call", lambda fn: times[launched[-1][:2]])
    monkeypatch.setattr(gemv_module, "_config", config)
    monkeypatch.setattr(gemv_module, "_launch", launch)
    monkeypatch.setattr(gemv_module, "INTERPRET", False)
    monkeypatch.setattr(gemv_module, "TUNE", True)
    monkeypatch.setattr(gemv_module, "_TUNED", {})
    with pytest.warns(UserWarning, match="off the reference"):
        gemv_module.int_gemv(x, *tensors, None, **static)  # tunes (fake), launches the winner
    gemv_module.int_gemv(x, *tensors, None, **static)  # cached: no second sweep
    # N = 37: one program; SPLIT_K = min(3 tiles, resident programs // 1)
    assert tensors[0].shape[1] // static["tile"] == 3
    assert launched[-2:] == [(16, 64, 3, 4, 1)] * 2
    assert all(c[:2] != shapes[1][:2] for c in launched)
    assert len(gemv_module._TUNED) == 1


# ---------------------------------------------------------------- real sizes, on CUDA only

GPU_SHAPES = [(4096, 4096), (4096, 11008)]
GPU_FORMATS = [(8, None, True), (4, 128, True), (4, 128, False), (3, 128, True), (2, 64, False)]


@pytest.fixture
def untuned(monkeypatch):
    """Default launch configurations: one compile per shape instead of a tuning sweep."""
    from lowbit.kernels import int_gemm as gemm_module
    from lowbit.kernels import int_gemv as gemv_module

    monkeypatch.setattr(gemv_module, "TUNE", False)
    monkeypatch.setattr(gemm_module, "TUNE", False)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits, group, symmetric", GPU_FORMATS)
@pytest.mark.parametrize("n, k", GPU_SHAPES)
def test_kernels_at_layer_sizes_on_cuda(n, k, bits, group, symmetric, dtype, untuned):
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: the kernels are not compiled")
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(n, k, generator=gen) * 0.02
    q = IntQuantized.from_float(
        weight, bits, group_size=group, symmetric=symmetric, scale_dtype=torch.float16
    )
    fast = PackedLinear.from_quantized(q, backend="triton").cuda()
    reference = PackedLinear.from_quantized(q, backend="reference").cuda()
    for m in (1, 16, 300):
        x = torch.randn(m, k, generator=gen).to("cuda", dtype)
        assert _rel_err(fast(x), reference(x)) <= TOL[dtype], m


@pytest.mark.gpu
def test_tuning_picks_a_configuration_that_computes_the_same():
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: nothing is tuned")
    gen = torch.Generator().manual_seed(0)
    q = IntQuantized.from_float(torch.randn(4096, 4096, generator=gen), 4, group_size=128)
    fast = PackedLinear.from_quantized(q, backend="triton").cuda()
    reference = PackedLinear.from_quantized(q, backend="reference").cuda()
    for m in (1, 8, 512):
        x = torch.randn(m, 4096, generator=gen).to("cuda", torch.float16)
        assert _rel_err(fast(x), reference(x)) <= TOL[torch.float16], m


@pytest.mark.gpu
def test_every_gemv_candidate_launches_and_computes_the_product():
    """Every block shape the tuner may time, pipelined ones included, launches on this GPU at
    the up projection's shape and computes the reference's product."""
    if INTERPRET:
        pytest.skip("TRITON_INTERPRET=1: the kernels are not compiled")
    from lowbit.kernels import int_gemv as gemv_module

    gen = torch.Generator().manual_seed(0)
    q = IntQuantized.from_float(torch.randn(11008, 4096, generator=gen), 4, group_size=128)
    fast = PackedLinear.from_quantized(q, backend="triton").cuda()
    fast(torch.randn(1, 4096, device="cuda", dtype=torch.float16))  # prepares the layout
    tensors, static = _operands(fast)
    n_tiles = tensors[0].shape[1] // static["tile"]
    for m in (1, 16):
        x = torch.randn(m, 4096, generator=gen).to("cuda", torch.float16)
        args = (x, *tensors, None, static["bits"], static["group_size"], static["tile"])
        want = tiled_reference(*args)
        for shape in gemv_module._candidates(m):
            config = gemv_module._config(args, shape, n_tiles)
            assert not isinstance(config, str), (shape, config)
            got = gemv_module._launch(*args, config)
            assert _rel_err(got, want) <= TOL[torch.float16], (m, shape)
