import pytest

from lowbit.api import quantize
from lowbit.eval.memory import float_kv_bytes_per_token, memory_report
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe

# tiny llama per block: q 96x96, k 32x96, v 32x96, o 96x96, gate 160x96, up 160x96, down 96x160
WEIGHTS_PER_BLOCK = 96 * 96 * 2 + 32 * 96 * 2 + 160 * 96 * 3
ROWS_PER_BLOCK = 96 + 32 + 32 + 96 + 160 + 160 + 96  # output channels: one scale each
SCALE_BITS = 16  # fp16 scales


@pytest.mark.parametrize(
    "settings, expected",
    [
        ({"w_bits": "16", "a_bits": "8"}, 32.0),  # float weights
        ({"w_bits": "4", "w_group": "32"}, 4 + SCALE_BITS / 32),
        ({"w_bits": "4", "w_group": "32", "w_symmetric": "false"}, 4 + (SCALE_BITS + 4) / 32),
        ({"w_bits": "3", "w_group": "16", "w_symmetric": "false"}, 3 + (SCALE_BITS + 3) / 16),
        ({"w_bits": "4"}, 4 + SCALE_BITS * ROWS_PER_BLOCK / WEIGHTS_PER_BLOCK),
    ],
)
def test_bits_per_weight_equals_hand_computed(settings, expected):
    model = quantize(tiny_model("llama"), get_recipe("rtn", **settings), progress=False)
    report = memory_report(model, adapter_for(model))
    assert report.linear_weights == 2 * WEIGHTS_PER_BLOCK
    assert report.bits_per_weight == pytest.approx(expected, rel=1e-12)


def test_model_bytes_count_tied_embeddings_once_and_quantized_linears_packed():
    model = tiny_model("llama")
    float_report = memory_report(model, adapter_for(model))
    embedding = 256 * 96 * 4
    norms = (2 * 2 + 1) * 96 * 4
    assert float_report.model_bytes == embedding + norms + 2 * WEIGHTS_PER_BLOCK * 4
    quantize(model, get_recipe("rtn", w_bits="4", w_group="32"), progress=False)
    report = memory_report(model, adapter_for(model))
    assert report.model_bytes == embedding + norms + 2 * WEIGHTS_PER_BLOCK * 4.5 / 8


def test_float_kv_bytes_per_token():
    adapter = adapter_for(tiny_model("llama"))
    assert (
        float_kv_bytes_per_token(adapter) == 2 * 2 * 2 * 16 * 2
    )  # K+V, layers, kv heads, dim, fp16
    report = memory_report(tiny_model("llama"), adapter)
    assert report.kv_bytes_per_token == 256
