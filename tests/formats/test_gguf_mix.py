"""llama.cpp's file types as per-tensor types (lowbit.formats.gguf_mix): the type lowbit gives
every tensor is the one llama.cpp's own quantizer (``llama_model_quantize``) writes."""

import ctypes

import gguf
import pytest

from lowbit.errors import LowbitError
from lowbit.formats.gguf_mix import FILE_TYPES, file_type, tensor_type
from lowbit.io.gguf import export_gguf
from lowbit.models.tiny import tiny_model, tiny_tokenizer

# 16 layers: llama.cpp's first/last eighths and sixteenths differ; rows of 288 (q, k, v, o,
# gate, up: no 256-weight block, the fallbacks) and 256 (ffn_down: the K types themselves)
SHAPE = dict(hidden_size=288, intermediate_size=256, num_attention_heads=4, head_dim=72,
             num_hidden_layers=16)  # fmt: skip
QUANTIZED = [name for name in FILE_TYPES if name != "F32"]


def _llama_quantize(source, out, ftype: str, *, pure=False):
    llama_cpp = pytest.importorskip("llama_cpp")
    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = FILE_TYPES[ftype][0]
    params.pure = pure
    assert llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(),
                                          ctypes.byref(params)) == 0  # fmt: skip


@pytest.fixture(scope="module", params=[(1, True), (2, False)], ids=["gqa4-tied", "gqa2-untied"])
def float_file(request, tmp_path_factory):
    kv_heads, tied = request.param
    tokenizer = tiny_tokenizer()
    model = tiny_model("llama", vocab_size=len(tokenizer), num_key_value_heads=kv_heads,
                       tie_word_embeddings=tied, **SHAPE)  # fmt: skip
    path = tmp_path_factory.mktemp("mix") / "f32.gguf"
    export_gguf(model, path, tokenizer=tokenizer)
    return path, 4 // kv_heads, tied


def _expected(name: str, ftype: str, n_gqa: int, tied: bool, pure: bool) -> str:
    parts = name.split(".")
    if parts[0] == "blk":
        width = SHAPE["intermediate_size"] if parts[2] == "ffn_down" else SHAPE["hidden_size"]
        return tensor_type(ftype, parts[2], layer=int(parts[1]), n_layers=16, n_gqa=n_gqa,
                           width=width, tied=tied, pure=pure)  # fmt: skip
    return tensor_type(ftype, parts[0], width=SHAPE["hidden_size"], tied=tied, pure=pure)


@pytest.mark.parametrize("ftype", QUANTIZED)
def test_every_tensor_gets_llama_cpps_type(float_file, ftype, tmp_path):
    source, n_gqa, tied = float_file
    _llama_quantize(source, tmp_path / "q.gguf", ftype)
    reader = gguf.GGUFReader(tmp_path / "q.gguf")
    seen = set()
    for t in reader.tensors:
        if t.name.endswith("norm.weight"):
            continue
        expected = _expected(t.name, ftype, n_gqa, tied, pure=False)
        assert t.tensor_type.name == expected, t.name
        seen.add(expected)
    assert len(seen) > 1 or ftype == "Q8_0"  # the others mix types here (fallbacks at least)


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q2_K"])
def test_pure_is_llama_quantizes_pure(float_file, ftype, tmp_path):
    source, n_gqa, tied = float_file
    _llama_quantize(source, tmp_path / "q.gguf", ftype, pure=True)
    for t in gguf.GGUFReader(tmp_path / "q.gguf").tensors:
        if not t.name.endswith("norm.weight"):
            assert t.tensor_type.name == _expected(t.name, ftype, n_gqa, tied, pure=True), t.name


def test_names_and_fallbacks():
    assert file_type("q4_k") == "Q4_K_M"  # llama-quantize's alias
    assert tensor_type("Q4_K_M", "attn_q", width=576) == "Q5_0"
    assert tensor_type("Q6_K", "attn_q", width=576) == "Q8_0"
    assert tensor_type("Q2_K", "attn_q", width=576) == "Q4_0"
    assert tensor_type("Q4_K_M", "attn_q", width=1024) == "Q4_K"
    assert tensor_type("Q4_0", "attn_q", width=48) == "F16"  # no block divides the row
    with pytest.raises(LowbitError, match="unknown GGUF file type 'Q7_K'"):
        file_type("Q7_K")
