import pytest
import torch

import lowbit
from lowbit.algorithms.mixed import MixedWeightSpec
from lowbit.algorithms.qat import choose_on_float, mixed_qat
from lowbit.errors import LowbitError
from lowbit.formats.mixed import GROUP
from lowbit.models.adapter import adapter_for
from lowbit.models.tiny import tiny_model
from lowbit.recipes.registry import get_recipe


def _ids(n=4, seqlen=32):
    return torch.randint(0, 128, (n, seqlen), generator=torch.Generator().manual_seed(0))


def test_choices_on_the_float_model_leave_it_unchanged():
    model, ids = tiny_model("llama"), _ids()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    spec = MixedWeightSpec(frac_4bit=0.25, outlier_fraction=0.01)
    choices = choose_on_float(model, adapter_for(model), ids, lambda fqn: spec)
    assert len(choices) == 14
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    down = choices["model.layers.0.mlp.down_proj"]  # 160 wide: 10 groups, 2 or 3 in 4 bits
    assert down.sensitivity.shape == (10,) and int(down.is4.sum()) == round(0.25 * 10)
    top = torch.argsort(down.sensitivity, descending=True)[: int(down.is4.sum())]
    assert bool(down.is4[top].all())
    cols = torch.nonzero(down.outliers)[:, 1]
    assert cols.numel() == round(0.01 * 96 * 160) and not bool(down.is4[cols // GROUP].any())


def test_qat_fine_tunes_then_gptq_keeps_its_groups():
    model, ids = tiny_model("llama"), _ids()
    layer = "model.layers.0.mlp.down_proj"
    before = model.get_submodule(layer).weight.detach().clone()
    recipe = get_recipe("mixed", qat_steps=4, qat_seqlen=16, qat_lr=1e-3)
    lowbit.quantize(model, recipe, calibration=ids, progress=False)
    report = model.lowbit_qat_report
    assert report.steps == 4 and len(report.losses) == 4 and report.seconds > 0
    _, stats, _ = model.get_submodule(layer).quantized_weight.unpack()
    assert torch.equal(stats.is4, report.is4[layer])  # GPTQ used the groups QAT trained with
    # the weights GPTQ quantized are the fine-tuned ones: not those of the float model
    fresh = tiny_model("llama")
    lowbit.quantize(fresh, get_recipe("mixed"), calibration=ids, progress=False)
    assert not torch.equal(model.get_submodule(layer).weight, fresh.get_submodule(layer).weight)
    assert not torch.equal(model.get_submodule(layer).weight, before)
    # the flags QAT changed are back: quantized weights frozen, the rest as the model had them
    flags = {n: p.requires_grad for n, p in tiny_model("llama").named_parameters()}
    assert all(p.requires_grad == flags[n] for n, p in model.named_parameters() if "norm" in n)
    assert not any(
        m.weight.requires_grad for m in model.modules() if hasattr(m, "quantized_weight")
    )


def test_qat_refusals():
    model = tiny_model("llama")
    spec = MixedWeightSpec()
    with pytest.raises(LowbitError, match="calibration"):
        mixed_qat(model, adapter_for(model), None, lambda fqn: spec, steps=2)
    with pytest.raises(LowbitError, match="seqlen"):
        mixed_qat(model, adapter_for(model), _ids(2, 8), lambda fqn: spec, steps=2, seqlen=16)
