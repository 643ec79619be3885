"""Model adapters: the one place in lowbit that knows layer names.

Transforms, calibration, algorithms and caches ask an adapter where things are (embeddings,
norms, projections, RoPE, lm_head, head counts) and never name a module themselves. One adapter
class per architecture family; families that share Llama's layout differ only in small facts
(biases on q/k/v, per-head q/k norms, sliding windows).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from lowbit.errors import LowbitError


@dataclass
class BlockView:
    """Named handles to the parts of one decoder block."""

    index: int
    block: nn.Module
    attn: nn.Module
    mlp: nn.Module
    input_norm: nn.Module  # RMSNorm read by q/k/v
    post_attention_norm: nn.Module  # RMSNorm read by gate/up
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    q_norm: nn.Module | None = None  # per-head RMSNorm on head_dim (Qwen3)
    k_norm: nn.Module | None = None

    LINEAR_NAMES: ClassVar[tuple[str, ...]] = (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    )

    def linears(self) -> dict[str, nn.Linear]:
        """The block's linear layers by short name, in execution order."""
        return {name: getattr(self, name) for name in self.LINEAR_NAMES}


class DecoderAdapter:
    """Adapter for the Llama-style decoder layout shared by the supported families.

    Subclasses set ``family``, ``model_types`` and override what differs.
    """

    family: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    rope_style: ClassVar[str] = "rotate_half"  # channel i pairs with i + head_dim/2

    def __init__(self, model: nn.Module):
        self.model = model
        self.config = model.config
        self.decoder = model.model  # embed_tokens, layers, norm, rotary_emb

    # -- dimensions ---------------------------------------------------------------------------
    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    @property
    def num_heads(self) -> int:
        return self.config.num_attention_heads

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.config, "num_key_value_heads", None) or self.num_heads

    @property
    def head_dim(self) -> int:
        head_dim = getattr(self.config, "head_dim", None)
        return head_dim or self.hidden_size // self.num_heads

    @property
    def gqa_group(self) -> int:
        """Query heads per key/value head."""
        return self.num_heads // self.num_kv_heads

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size

    @property
    def num_layers(self) -> int:
        return len(self.decoder.layers)

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def rms_norm_eps(self) -> float:
        return float(self.config.rms_norm_eps)

    @property
    def max_context(self) -> int:
        return int(getattr(self.config, "max_position_embeddings", 0) or 0)

    # -- modules ------------------------------------------------------------------------------
    @property
    def embed_tokens(self) -> nn.Embedding:
        return self.decoder.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        return self.decoder.norm

    @property
    def lm_head(self) -> nn.Linear:
        return self.model.lm_head

    @property
    def blocks_module(self) -> nn.ModuleList:
        return self.decoder.layers

    @property
    def tied_embeddings(self) -> bool:
        """True when lm_head and the embeddings share one weight tensor."""
        return self.lm_head.weight is self.embed_tokens.weight

    def block(self, index: int) -> BlockView:
        layer = self.decoder.layers[index]
        attn, mlp = layer.self_attn, layer.mlp
        return BlockView(
            index=index,
            block=layer,
            attn=attn,
            mlp=mlp,
            input_norm=layer.input_layernorm,
            post_attention_norm=layer.post_attention_layernorm,
            q_proj=attn.q_proj,
            k_proj=attn.k_proj,
            v_proj=attn.v_proj,
            o_proj=attn.o_proj,
            gate_proj=mlp.gate_proj,
            up_proj=mlp.up_proj,
            down_proj=mlp.down_proj,
            q_norm=getattr(attn, "q_norm", None),
            k_norm=getattr(attn, "k_norm", None),
        )

    def replace_attention(self, index: int, module: nn.Module) -> None:
        """Put ``module`` in place of block ``index``'s attention module.

        The new module must keep the projection attribute names (``q_proj`` ... ``o_proj``,
        ``q_norm``/``k_norm``) so that :meth:`block` and :meth:`linear_names` still find them.
        """
        self.decoder.layers[index].self_attn = module

    def blocks(self) -> list[BlockView]:
        return [self.block(i) for i in range(self.num_layers)]

    def block_prefix(self, index: int) -> str:
        """Fully qualified name of block ``index`` inside the model."""
        return f"model.layers.{index}"

    def linear_names(self) -> list[str]:
        """Fully qualified names of every linear in the decoder blocks, in execution order."""
        return [
            f"{self.block_prefix(i)}.{part}.{name}"
            for i in range(self.num_layers)
            for part, name in (
                ("self_attn", "q_proj"),
                ("self_attn", "k_proj"),
                ("self_attn", "v_proj"),
                ("self_attn", "o_proj"),
                ("mlp", "gate_proj"),
                ("mlp", "up_proj"),
                ("mlp", "down_proj"),
            )
        ]

    # -- RoPE ---------------------------------------------------------------------------------
    def rope_cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype = torch.float32
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the given positions: [B, S] -> two [B, S, head_dim] tensors."""
        probe = torch.empty(0, dtype=dtype, device=positions.device)
        return self.decoder.rotary_emb(probe, positions)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Rotate queries or keys by their positions.

        Args:
            x: [B, H, S, head_dim]
            positions: [B, S] integer positions (true positions, so left padding stays right)
        """
        cos, sin = self.rope_cos_sin(positions.to(x.device), x.dtype)  # [B, S, D] on x's device
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [B, 1, S, D]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def rope_pair_partner(self) -> torch.Tensor:
        """For each channel of a head, the channel RoPE rotates it with: [head_dim] long."""
        half = self.head_dim // 2
        idx = torch.arange(self.head_dim)
        return torch.where(idx < half, idx + half, idx - half)


class LlamaAdapter(DecoderAdapter):
    family = "llama"
    model_types = ("llama",)


class MistralAdapter(DecoderAdapter):
    family = "mistral"
    model_types = ("mistral",)


class Qwen2Adapter(DecoderAdapter):
    """Qwen2: biases on q/k/v."""

    family = "qwen2"
    model_types = ("qwen2",)


class Qwen3Adapter(DecoderAdapter):
    """Qwen3: per-head RMSNorm on q and k (over head_dim) before RoPE."""

    family = "qwen3"
    model_types = ("qwen3",)


ADAPTERS: tuple[type[DecoderAdapter], ...] = (
    LlamaAdapter,
    MistralAdapter,
    Qwen2Adapter,
    Qwen3Adapter,
)


def supported_families() -> list[str]:
    return [cls.family for cls in ADAPTERS]


def adapter_for(model: nn.Module) -> DecoderAdapter:
    """The adapter for ``model``'s family, or a LowbitError naming the supported ones."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    for cls in ADAPTERS:
        if model_type in cls.model_types:
            return cls(model)
    raise LowbitError(
        f"lowbit has no adapter for the architecture {model_type!r}; "
        f"supported families: {', '.join(supported_families())}"
    )
