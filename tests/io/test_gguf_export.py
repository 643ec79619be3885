"""GGUF export (lowbit.io.gguf): every block linear the ``gguf`` reader decodes equals lowbit's
simulated weight bit for bit; llama.cpp loads and runs the file (when llama-cpp-python is
installed: the ``gguf`` extra, ``make test`` installs it)."""

import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch

from lowbit.api import quantize
from lowbit.errors import LowbitError
from lowbit.formats.gguf_mix import FILE_TYPES, tensor_type
from lowbit.io.checkpoint import load, save
from lowbit.io.gguf import check_gguf_recipe, export_gguf
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import save_tiny_model, tiny_model, tiny_tokenizer
from lowbit.recipes.registry import get_recipe

# widths multiples of 32 (llama.cpp's blocks), heads of 32 so RoPE rows permute in whole blocks
SHAPE = dict(hidden_size=128, intermediate_size=192, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32)  # fmt: skip
# widths multiples of 256: every K type without fallbacks
SHAPE_256 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=64)  # fmt: skip
K_TYPES = {"Q6_K": "Q6_K", "Q5_K_M": "Q5_K", "Q4_K_M": "Q4_K", "Q3_K_M": "Q3_K", "Q2_K": "Q2_K"}
FAMILIES = ["llama", "mistral", "qwen2", "qwen3"]
GGUF_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
              "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _quantized(family, tokenizer, recipe="gguf", shape=SHAPE, **settings):
    model = tiny_model(family, vocab_size=len(tokenizer), **shape)
    calibration = torch.randint(
        3, len(tokenizer), (4, 32), generator=torch.Generator().manual_seed(0)
    )
    quantize(model, get_recipe(recipe, **settings), calibration=calibration, progress=False)
    return model


def _unpermute(rows, heads):
    """llama.cpp's RoPE row order back to transformers' (the inverse of the export's)."""
    shape = rows.shape
    return rows.reshape(heads, shape[0] // heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _logits_here_and_in_llama_cpp(llama_cpp, model, path, tokens: int, seed: int, high=None):
    """``(lowbit's logits, llama.cpp's on the file at path)`` [tokens, vocab] each, for the
    same random ids in [3, high) (never the special ones below 3; high: the vocabulary)."""
    high = model.config.vocab_size if high is None else high
    ids = torch.randint(3, high, (tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        expected = model(ids[None]).logits[0].numpy()  # [tokens, vocab]
    llm = llama_cpp.Llama(str(path), n_ctx=2 * tokens + 16, n_threads=1, logits_all=True,
                          verbose=False)  # fmt: skip
    llm.eval(ids.tolist())
    return expected, np.asarray(llm.scores[:tokens])  # [tokens, vocab]


def _check_file(path, model):
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    adapter = adapter_for(model)
    for block in adapter.blocks():
        for short, module in block.linears().items():
            t = tensors[f"blk.{block.index}.{GGUF_NAMES[short]}.weight"]
            decoded = gguf.quants.dequantize(t.data, t.tensor_type)  # [out, in] fp32
            if adapter.family in ("llama", "mistral") and short in ("q_proj", "k_proj"):
                decoded = _unpermute(
                    decoded, adapter.num_heads if short == "q_proj" else adapter.num_kv_heads
                )
            simulated = module.weight.detach().float().numpy()
            assert decoded.shape == simulated.shape
            assert np.array_equal(decoded.view(np.uint32), simulated.view(np.uint32)), t.name
    return reader, tensors


@pytest.mark.parametrize("family", FAMILIES)
def test_every_exported_linear_is_the_simulated_weight(family, tokenizer, tmp_path):
    model = _quantized(family, tokenizer, gguf_type="Q4_0", w_algo="rtn")
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    reader, tensors = _check_file(tmp_path / "m.gguf", model)
    arch = reader.fields["general.architecture"].contents()
    assert arch == {"mistral": "llama"}.get(family, family)
    assert tensors["token_embd.weight"].tensor_type.name == "Q8_0"  # tied: llama.cpp's output type
    assert ("blk.0.attn_q.bias" in tensors) == (family == "qwen2")
    assert ("blk.0.attn_q_norm.weight" in tensors) == (family == "qwen3")
    assert not list((tmp_path).glob(".*tmp*"))  # written to a temporary, then renamed


@pytest.mark.parametrize("gguf_type", ["Q8_0", "Q5_0", "Q5_1", "Q4_1", "IQ4_NL"])
def test_gptq_on_every_grid_exports_bit_for_bit(gguf_type, tokenizer, tmp_path):
    model = _quantized("llama", tokenizer, gguf_type=gguf_type, w_algo="gptq")
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    _, tensors = _check_file(tmp_path / "m.gguf", model)
    assert tensors["blk.1.ffn_down.weight"].tensor_type.name == gguf_type


@pytest.mark.parametrize("gguf_type", list(K_TYPES))
def test_every_k_type_exports_bit_for_bit(gguf_type, tokenizer, tmp_path):
    # GPTQ's weight is its container bit for bit (tests/algorithms/test_gguf_spec.py); here
    # the container reaches the file, by GPTQ on one type and RTN on the others
    algo = "gptq" if gguf_type == "Q4_K_M" else "rtn"
    model = _quantized("llama", tokenizer, shape=SHAPE_256, gguf_type=gguf_type, pure=True,
                       w_algo=algo)  # fmt: skip
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    reader, tensors = _check_file(tmp_path / "m.gguf", model)
    linears = [t for name, t in tensors.items() if name.startswith("blk.") and "norm" not in name]
    assert {t.tensor_type.name for t in linears} == {K_TYPES[gguf_type]}  # pure: no fallbacks
    # pure: the tied output matrix on the default type too, as llama-quantize --pure does
    assert tensors["token_embd.weight"].tensor_type.name == K_TYPES[gguf_type]
    assert reader.fields["general.file_type"].contents() == FILE_TYPES[gguf_type][0]


@pytest.mark.parametrize("shape", [SHAPE, SHAPE_256], ids=["rows-128", "rows-256"])
def test_a_named_mix_types_every_tensor_by_llama_cpps_rules(shape, tokenizer, tmp_path):
    model = _quantized("llama", tokenizer, shape=shape, gguf_type="Q3_K_M", w_algo="rtn")
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    _, tensors = _check_file(tmp_path / "m.gguf", model)
    adapter = adapter_for(model)
    for block in adapter.blocks():
        for short, linear in block.linears().items():
            expected = tensor_type("Q3_K_M", GGUF_NAMES[short], layer=block.index,
                                   n_layers=adapter.num_layers, n_gqa=2,
                                   width=linear.in_features)  # fmt: skip
            got = tensors[f"blk.{block.index}.{GGUF_NAMES[short]}.weight"].tensor_type.name
            assert got == expected
    types = {t.tensor_type.name for t in tensors.values()}
    # Q3_K_M: attn_v Q5_K in the first two layers, attn_output Q4_K, the rest Q3_K; on rows of
    # 128 every K type falls back onto a 32-weight type
    assert types >= ({"Q5_K", "Q4_K", "Q3_K"} if shape is SHAPE_256 else {"Q4_0", "Q5_1"})


LEARNED_WEIGHT_ONLY = dict(a_bits=16, v_bits=16, train_w_bits=4, steps=3, lr=1e-2)


@pytest.mark.parametrize(
    ("rotation", "settings"), [("rotate", {}), ("learn-rotate", LEARNED_WEIGHT_ONLY)]
)
def test_rotated_model_exports_its_own_output_matrix(tokenizer, tmp_path, rotation, settings):
    recipe = f"{rotation}+gguf"
    model = _quantized("llama", tokenizer, recipe, online=False, gguf_type="Q4_0", **settings)
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    _, tensors = _check_file(tmp_path / "m.gguf", model)
    assert tensors["output.weight"].tensor_type.name == "Q8_0"
    assert tensors["token_embd.weight"].tensor_type.name == "Q4_0"  # untied: the file's type
    norm = tensors["blk.0.attn_norm.weight"].data
    assert np.array_equal(norm, np.ones_like(norm))  # fused into the linears


def test_a_saved_packed_model_exports_the_same_blocks(tokenizer, tmp_path):
    model = _quantized("llama", tokenizer, gguf_type="IQ4_NL", w_algo="rtn")
    export_gguf(model, tmp_path / "a.gguf", tokenizer=tokenizer)
    save(model, tmp_path / "saved", tokenizer=tokenizer)
    loaded = load(tmp_path / "saved", dtype=torch.float32)  # the float tensors as stored
    export_gguf(loaded, tmp_path / "b.gguf", tokenizer=tokenizer)
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    for ta, tb in zip(a.tensors, b.tensors, strict=True):
        assert ta.name == tb.name and np.array_equal(ta.data, tb.data)


@pytest.mark.parametrize(
    "recipe, message",
    [
        ({"method": "gptq"}, "gptq has no GGUF form"),
        (
            {
                "method": "compose",
                "parts": [{"method": "rotate", "settings": {}}, {"method": "gguf"}],
            },
            "online=false",
        ),  # fmt: skip
        (
            {"method": "compose", "parts": [{"method": "gguf"}, {"method": "kvquant"}]},
            "kvquant is not one of llama.cpp's block grids",
        ),  # fmt: skip
        (
            {"method": "compose", "parts": [{"method": "learn-rotate"}, {"method": "gguf"}]},
            "learn-rotate adds online Hadamards",
        ),  # fmt: skip
        ({"method": "rotate", "settings": {"online": False}}, "leaves the block linears in float"),
    ],
)
def test_recipes_without_a_gguf_form_are_refused_before_loading(recipe, message):
    with pytest.raises(LowbitError, match=message):
        check_gguf_recipe(recipe)


def test_a_model_the_gguf_recipe_did_not_quantize_is_one_sentence(tokenizer, tmp_path):
    model = _quantized("llama", tokenizer, "rtn", w_bits=4)
    with pytest.raises(LowbitError, match="not quantized by the gguf recipe"):
        export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    assert not (tmp_path / "m.gguf").exists()


def test_cli_exports_from_a_recipe_in_another_process(tmp_path):
    save_tiny_model(tmp_path / "tiny", "llama", **SHAPE)
    out = tmp_path / "m.gguf"
    command = [sys.executable, "-m", "lowbit", "export", "--model", str(tmp_path / "tiny"),
               "--recipe", "gguf", "--type", "q5_1", "--set", "w_algo=rtn", "--format", "gguf",
               "--out", str(out), "--no-progress"]  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert gguf.GGUFReader(out).fields["general.file_type"].contents() == 9  # MOSTLY_Q5_1
    command[command.index("gguf") : command.index("gguf") + 1] = ["gptq"]
    proc = subprocess.run(command, capture_output=True, text=True)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert "gptq has no GGUF form" in proc.stderr


@pytest.mark.parametrize(
    "family, gguf_type, pure, rotation",
    [(family, "Q4_0", False, None) for family in FAMILIES]
    + [("llama", t, False, None) for t in ("Q8_0", "Q5_0", "Q5_1", "Q4_1", "IQ4_NL")]
    # the mixes: every K type among their tensors, the output matrix on Q6_K (lowbit's own
    # logits come from the float output matrix; a pure Q2_K one moves them by 0.4)
    + [("llama", t, False, None) for t in K_TYPES]
    # a learned rotation fused into a standard graph
    + [("llama", "Q4_0", False, "learn-rotate")],
)
def test_llama_cpp_loads_and_runs_the_export(
    family, gguf_type, pure, rotation, tokenizer, tmp_path
):
    llama_cpp = pytest.importorskip("llama_cpp")
    shape = SHAPE_256 if "K" in gguf_type else SHAPE
    recipe, settings = "gguf", {}
    if rotation is not None:
        recipe, settings = f"{rotation}+gguf", dict(online=False, **LEARNED_WEIGHT_ONLY)
    model = _quantized(family, tokenizer, recipe, shape=shape, gguf_type=gguf_type, pure=pure,
                       w_algo="rtn", **settings)  # fmt: skip
    export_gguf(model, tmp_path / "m.gguf", tokenizer=tokenizer)
    expected, got = _logits_here_and_in_llama_cpp(llama_cpp, model, tmp_path / "m.gguf", 24, 1)
    # llama.cpp multiplies with 8-bit activations and reads a Q8_0 embedding; lowbit's float
    # activations and embedding: measured max difference 0.016 on logits of magnitude 1.4; the
    # random model's near-uniform logits let top-1 flip (measured 0.83 at worst, Q5_K)
    assert np.abs(got - expected).max() < 0.1
    assert (got.argmax(-1) == expected.argmax(-1)).mean() >= 0.75


def test_a_float_model_is_written_in_f32_with_the_same_logits_in_llama_cpp(tokenizer, tmp_path):
    llama_cpp = pytest.importorskip("llama_cpp")
    model = tiny_model("qwen2", vocab_size=len(tokenizer), **SHAPE)
    export_gguf(model, tmp_path / "f.gguf", tokenizer=tokenizer)
    reader = gguf.GGUFReader(tmp_path / "f.gguf")
    assert {t.tensor_type.name for t in reader.tensors} == {"F32"}
    assert reader.fields["general.file_type"].contents() == 0  # ALL_F32
    expected, got = _logits_here_and_in_llama_cpp(llama_cpp, model, tmp_path / "f.gguf", 16, 2)
    # F32 weights: llama.cpp's matmuls and attention differ from torch's by rounding only
    assert np.abs(got - expected).max() < 1e-3


def test_the_output_matrix_rounded_a_slab_of_rows_at_a_time_is_the_same_bytes(
    tokenizer, tmp_path, monkeypatch
):
    import lowbit.io.gguf as gguf_io

    model = _quantized("llama", tokenizer, gguf_type="Q4_0", w_algo="rtn")
    export_gguf(model, tmp_path / "whole.gguf", tokenizer=tokenizer)
    vocab = model.lm_head.weight.shape[0]
    monkeypatch.setattr(gguf_io, "_RTN_ROWS", 7)  # slabs that end mid-way, a short last one
    assert vocab % 7
    export_gguf(model, tmp_path / "slabs.gguf", tokenizer=tokenizer)
    assert (tmp_path / "whole.gguf").read_bytes() == (tmp_path / "slabs.gguf").read_bytes()


def test_the_file_written_a_tensor_at_a_time_is_what_ggufs_own_writer_writes(tokenizer, tmp_path):
    """The export declares every tensor's shape and bytes before it makes any; gguf's
    writer, given all the arrays at once, must write the same file."""
    from lowbit.io.gguf import _hf_tokenizer_fields, _metadata, gguf_tensors

    model = _quantized("qwen2", tokenizer, gguf_type="Q4_K_M", w_algo="rtn", shape=SHAPE_256)
    export_gguf(model, tmp_path / "lowbit.gguf", tokenizer=tokenizer)
    ftype, tensors = gguf_tensors(model)
    writer = gguf.GGUFWriter(tmp_path / "reference.gguf", "qwen2")
    _metadata(writer, model, ftype, "lowbit")
    _hf_tokenizer_fields(writer, tokenizer, "default", len(tokenizer))
    for t in tensors:
        data = t.data()
        qtype = None if t.type_name in ("F32", "F16") else gguf.GGMLQuantizationType[t.type_name]
        writer.add_tensor(t.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert any(t.type_name not in ("F32", "F16") for t in tensors)
    assert (tmp_path / "lowbit.gguf").read_bytes() == (tmp_path / "reference.gguf").read_bytes()


def test_an_embedding_with_more_rows_than_the_tokenizer_has_tokens_loads_in_llama_cpp(
    tokenizer, tmp_path
):
    """Padded vocabularies (a multiple of 64 or 128 rows) and the shaped benchmark models:
    llama.cpp sizes the vocabulary by the token list, so the list is padded to the rows."""
    llama_cpp = pytest.importorskip("llama_cpp")
    rows = len(tokenizer) + 13
    model = tiny_model("llama", vocab_size=rows, **SHAPE)
    export_gguf(model, tmp_path / "f.gguf", tokenizer=tokenizer)
    tokens = gguf.GGUFReader(tmp_path / "f.gguf").fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == rows
    expected, got = _logits_here_and_in_llama_cpp(
        llama_cpp, model, tmp_path / "f.gguf", 8, 3, high=len(tokenizer)
    )
    assert np.abs(got - expected).max() < 1e-3  # F32, as above
