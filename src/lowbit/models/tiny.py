"""Tiny random-weight models of each supported family, built from configs (no downloads).

Their shapes are deliberately awkward: GQA, head counts that are not powers of two, a width
with an odd factor, tied embeddings. Tests and examples use them; nothing here is trained.
"""

from __future__ import annotations

import torch

FAMILY_CONFIGS = {
    "llama": "LlamaConfig",
    "mistral": "MistralConfig",
    "qwen2": "Qwen2Config",
    "qwen3": "Qwen3Config",
}


def tiny_config(family: str = "llama", **overrides):
    """A small config: hidden 96 = 6 heads x 16, 2 KV heads, intermediate 160, 2 layers."""
    import transformers

    if family not in FAMILY_CONFIGS:
        raise ValueError(f"unknown family {family!r}; choose from {sorted(FAMILY_CONFIGS)}")
    settings = dict(
        vocab_size=256,
        hidden_size=96,
        intermediate_size=160,
        num_hidden_layers=2,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if family == "qwen2":
        settings["use_sliding_window"] = False
    if family == "mistral":
        settings["sliding_window"] = None
    settings.update(overrides)
    return getattr(transformers, FAMILY_CONFIGS[family])(**settings)


def tiny_model(family: str = "llama", seed: int = 0, **overrides) -> torch.nn.Module:
    """A random-weight causal LM of ``family`` in fp32 eval mode.

    Norm weights are randomized too (around 1) so that norm fusion is really exercised.
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            elif name.endswith(".bias"):
                param.copy_(0.1 * torch.randn_like(param))
    return model.eval()


def tiny_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on the pydoc calibration text (no downloads)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from lowbit.data import pydoc_text

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator([pydoc_text("calibration")[:200_000]], trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", bos_token="<s>", eos_token="</s>"
    )


def save_tiny_model(directory, family: str = "llama", seed: int = 0, **overrides) -> None:
    """Write a tiny model and its tokenizer as a Hugging Face directory."""
    tokenizer = tiny_tokenizer()
    model = tiny_model(family, seed=seed, vocab_size=len(tokenizer), **overrides)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
