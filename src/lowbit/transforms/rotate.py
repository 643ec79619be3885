"""QuaRot: rotate the residual stream and add online Hadamards, keeping the function exact.

Linear layers compute ``y = x W^T`` on row vectors (W is [out, in]). For an orthogonal Q
(``Q Q^T = I``) the residual stream ``x`` is replaced by ``x Q`` everywhere:

* embeddings write it: ``E ← E Q`` (each row is a residual vector);
* q/k/v, gate/up and lm_head read it: ``W ← W Q`` (``x Q (W Q)^T = x W^T``), biases unchanged;
* o_proj and down_proj write it: ``W ← Q^T W`` and ``b ← Q^T b`` (so ``y ← y Q``);
* the RMSNorms in between commute with Q once their scales are fused (``fuse.fuse_norms``):
  ``(x Q) / rms(x Q) = (x / rms(x)) Q``.

Q is QuaRot's randomized Hadamard ``H diag(s) / sqrt(n)`` (``rotation="hadamard"``), a Haar
random orthogonal matrix (``"random"``, the paper's Table 8), or the identity (``"none"``: no
residual rotation; the online Hadamards below are still added).

Online Hadamards make the inputs of the two linears that read non-residual activations
outlier-free too. Each is exact because an orthonormal T applied to a linear's input is undone
by ``W ← W T^T``, which is T applied to every row of W (``fast_hadamard_transform(W)`` for a
Hadamard):

* down_proj input (width = intermediate): T = H_inter/√n online; the linear becomes a
  ``FakeQuantLinear`` with an unquantized weight and ``input_transform=OnlineHadamard(...)``.
* o_proj input (width = heads · head_dim), by ``o_proj_hadamard``:

  - ``"factorized"`` (QuaRot): T = A ⊗ B with A = H_heads/√heads, B = H_head_dim/√head_dim.
    ``I ⊗ B`` is fused offline into v_proj's output rows, per KV head; attention mixes value
    vectors only within a head, with weights summing to one, so every query head's output
    (GQA: each KV head serves ``gqa_group`` query heads) comes out multiplied by the same B.
    ``A ⊗ I`` (mixing across heads) runs online (``CrossHeadHadamard``), and o_proj gets
    ``W ← W (A ⊗ B)^T``.
  - ``"full"``: T = H_width/√width online, ``W_o ← W_o T^T``.
  - ``"per_head"``: T = I ⊗ B, fused into v_proj and o_proj with nothing online (a
    block-diagonal T passes through attention like the factorized path's B, so running it
    online would cost work for the same product). The fallback when the width has no matrix.
  - ``"auto"``: factorized when heads and head_dim both have Hadamard matrices (cheapest online
    work: a transform of size heads, head_dim times per token), else full when the width has
    one (SmolLM2: 9 heads have none, 576 = 36·16 has), else per_head.

Everything is computed in float64 and cast back to each tensor's dtype; a randomized Hadamard
wider than ``DENSE_ROTATION_MAX`` is applied with the fast transform, never as a dense matrix. The Q·K Hadamard after
RoPE lives with the KV cache, not here, and nothing here quantizes.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from lowbit.errors import LowbitError
from lowbit.models.adapter import DecoderAdapter, adapter_for
from lowbit.nn.quant_linear import FakeQuantLinear, replace_module
from lowbit.nn.spec import Rebuildable, register_module
from lowbit.settings import dtype_from_name, dtype_name
from lowbit.transforms.fuse import fuse_norms, norms_are_fused, untie_embeddings
from lowbit.transforms.hadamard import (
    OnlineHadamard,
    fast_hadamard_transform,
    hadamard_factorization,
    hadamard_matrix,
    has_hadamard,
    random_hadamard_matrix,
    random_hadamard_signs,
    random_orthogonal_matrix,
)

__all__ = [
    "CrossHeadHadamard",
    "LayerRotation",
    "RotationReport",
    "residual_rotation",
    "rotate_model",
    "rotate_residual",
]

ROTATIONS = ("hadamard", "random", "none")
# Widths up to this use a dense float64 Q for the residual rotation (one GEMM per weight is
# faster there); wider randomized Hadamards use the fast transform, which is faster there and
# never forms an n×n matrix (timings in docs/results/quarot.md).
DENSE_ROTATION_MAX = 2048
O_PROJ_PATHS = ("auto", "full", "per_head", "factorized")


@register_module
class CrossHeadHadamard(Rebuildable, nn.Module):
    """Orthonormal Hadamard across heads, ``A ⊗ I_head_dim`` on a [..., heads · head_dim] input.

    Channel ``h · head_dim + d`` of the output is ``Σ_g A[h, g] x[g · head_dim + d]`` with
    ``A = H_heads / sqrt(heads)``: the same head-mixing for every position d within a head.

    Args:
        num_heads: size of the transform (needs a Hadamard matrix).
        head_dim: channels per head, left unmixed.
        compute_dtype: arithmetic dtype (default: the input's dtype).
    """

    spec_fields = {"num_heads": int, "head_dim": int, "compute_dtype": torch.dtype | None}

    def __init__(self, num_heads: int, head_dim: int, *, compute_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_heads, self.head_dim, self.compute_dtype = num_heads, head_dim, compute_dtype
        self.heads_transform = OnlineHadamard(num_heads, compute_dtype=compute_dtype)

    @property
    def n(self) -> int:
        """Width of the input this transform takes."""
        return self.num_heads * self.head_dim

    def spec(self) -> dict[str, Any]:
        return {
            "num_heads": self.num_heads,
            "head_dim": self.head_dim,
            "compute_dtype": dtype_name(self.compute_dtype),
        }

    @classmethod
    def from_spec(cls, spec: dict[str, Any]) -> CrossHeadHadamard:
        dtype = dtype_from_name(spec["compute_dtype"])
        return cls(spec["num_heads"], spec["head_dim"], compute_dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., heads · head_dim] -> same shape."""
        width = self.num_heads * self.head_dim
        if x.shape[-1] != width:
            raise LowbitError(f"CrossHeadHadamard expects last dim {width}, got {x.shape[-1]}")
        heads = x.reshape(*x.shape[:-1], self.num_heads, self.head_dim)  # [..., H, D]
        mixed = self.heads_transform(heads.transpose(-1, -2))  # [..., D, H]
        return mixed.transpose(-1, -2).reshape(x.shape)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_dim={self.head_dim}, "
            f"compute_dtype={self.compute_dtype}"
        )


@dataclass
class LayerRotation:
    """The online transforms of one block and the weights they were fused into."""

    index: int
    down_proj: str
    o_proj_path: str
    o_proj: str


@dataclass
class RotationReport:
    """What ``rotate_model`` did."""

    rotation: str
    seed: int
    hidden_size: int
    residual: str  # e.g. "randomized Hadamard H_576 (K=36, 2^4)"
    norms_fused: int
    untied: bool
    online_dtype: str | None
    o_proj_hadamard: str  # the resolved path
    layers: list[LayerRotation] = field(default_factory=list)
    hadamard_block: int | None = None  # block-diagonal online Hadamards of this order

    def to_dict(self) -> dict:
        return asdict(self)

    def summary(self) -> str:
        """A few lines for logs and the CLI."""
        first = self.layers[0] if self.layers else None
        lines = [
            f"residual rotation: {self.residual} (seed {self.seed})",
            f"norms fused: {self.norms_fused}; embeddings untied: {self.untied}",
        ]
        if first is not None:
            lines.append(f"down_proj input: {first.down_proj} (all {len(self.layers)} layers)")
            lines.append(f"o_proj input ({first.o_proj_path}): {first.o_proj}")
        return "\n".join(lines)


def _describe_hadamard(n: int) -> str:
    k, power = hadamard_factorization(n)
    return f"H_{n} (K={k} x 2^{int(math.log2(power))})"


def _rows_transformed(weight: torch.Tensor, transform) -> torch.Tensor:
    """``W T^T`` for an orthonormal T given as a last-axis transform: T applied to each row."""
    return transform(weight.detach().to(torch.float64))  # [out, in]


def _assign(param: torch.Tensor, value: torch.Tensor) -> None:
    with torch.no_grad():
        param.copy_(value.to(param.dtype))


# ---------------------------------------------------------------------------
# Residual stream.
# ---------------------------------------------------------------------------


def residual_rotation(hidden_size: int, rotation: str = "hadamard", *, seed: int = 0, device=None):
    """The residual rotation Q for a width, float64 [n, n] (None for ``"none"``), drawn on the
    CPU and put on ``device`` (default: the default device), so it is the same everywhere.

    Raises:
        LowbitError: unknown kind, or ``"hadamard"`` for a width with no known construction.
    """
    if rotation not in ROTATIONS:
        raise LowbitError(f"rotation must be one of {', '.join(ROTATIONS)}, got {rotation!r}")
    if rotation == "none":
        return None
    if rotation == "random":
        return random_orthogonal_matrix(hidden_size, seed=seed, device=device)
    if not has_hadamard(hidden_size):
        raise LowbitError(
            f"hidden size {hidden_size} has no known Hadamard construction; "
            "use rotation='random' for a random orthogonal rotation instead"
        )
    return random_hadamard_matrix(hidden_size, seed=seed, device=device)


def _randomized_hadamard_map(hidden_size: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``x ↦ x Q`` for Q = random_hadamard_matrix(hidden_size, seed=seed), without forming Q.

    ``x Q = (x H / sqrt(n)) diag(s)``, and ``x H / sqrt(n)`` is the fast transform with the
    K factor transposed (it applies ``kron(S, H_K^T) = H^T``, i.e. ``x ↦ x H / sqrt(n)``).
    O(n log n + n K) per row instead of O(n^2); used above ``DENSE_ROTATION_MAX``.
    """
    signs = random_hadamard_signs(hidden_size, seed=seed, device="cpu")  # [n] float64
    k, _ = hadamard_factorization(hidden_size)
    k_transposed = hadamard_matrix(k, device="cpu").T.contiguous()  # [K, K]: H_K (K minimal)

    def apply(x: torch.Tensor) -> torch.Tensor:  # [..., n] float64
        y = fast_hadamard_transform(x, K_matrix=k_transposed)
        return y * signs.to(x.device)

    return apply


def rotate_residual(
    model: nn.Module, q: torch.Tensor | Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Rotate the residual stream by an orthogonal Q, in place.

    Needs fused norms and untied embeddings (``fuse.fuse_norms`` does both).

    Args:
        model: a supported Hugging Face causal LM.
        q: Q as a [hidden, hidden] tensor, or the float64 map ``x [..., hidden] ↦ x Q``
            (only right products are needed: ``Q^T W = (W^T Q)^T``).

    Raises:
        LowbitError: if a residual norm still has a scale, the embeddings are tied, or q has
            the wrong shape.
    """
    adapter = adapter_for(model)
    hidden = adapter.hidden_size
    if isinstance(q, torch.Tensor):
        if tuple(q.shape) != (hidden, hidden):
            raise LowbitError(f"the rotation must be {hidden}x{hidden}, got {tuple(q.shape)}")
        dense = q.to(dtype=torch.float64, device=adapter.lm_head.weight.device)

        def times_q(x: torch.Tensor) -> torch.Tensor:
            return x @ dense
    else:
        times_q = q
    if not norms_are_fused(model):
        raise LowbitError("rotating needs RMSNorm scales fused first (call fuse_norms)")
    if adapter.tied_embeddings:
        raise LowbitError("rotating needs untied embeddings first (call untie_embeddings)")

    def read(param: torch.Tensor) -> None:  # W <- W Q (embeddings: E <- E Q)
        _assign(param, times_q(param.detach().to(torch.float64)))

    def write(linear: nn.Module) -> None:  # W <- Q^T W = (W^T Q)^T, b <- Q^T b
        weight_t = linear.weight.detach().to(torch.float64).T  # [in, hidden]
        _assign(linear.weight, times_q(weight_t).T)
        if linear.bias is not None:
            _assign(linear.bias, times_q(linear.bias.detach().to(torch.float64)))

    read(adapter.embed_tokens.weight)  # [vocab, hidden]
    for view in adapter.blocks():
        for linear in (view.q_proj, view.k_proj, view.v_proj, view.gate_proj, view.up_proj):
            read(linear.weight)
        write(view.o_proj)
        write(view.down_proj)
    read(adapter.lm_head.weight)


# ---------------------------------------------------------------------------
# Online Hadamards.
# ---------------------------------------------------------------------------


def _resolve_o_proj_path(adapter: DecoderAdapter, requested: str) -> str:
    heads, head_dim = adapter.num_heads, adapter.head_dim
    width = heads * head_dim
    possible = {
        "factorized": has_hadamard(heads) and has_hadamard(head_dim),
        "full": has_hadamard(width),
        "per_head": has_hadamard(head_dim),
    }
    if requested not in O_PROJ_PATHS:
        raise LowbitError(
            f"o_proj_hadamard must be one of {', '.join(O_PROJ_PATHS)}, got {requested!r}"
        )
    if requested == "auto":
        for path in ("factorized", "full", "per_head"):
            if possible[path]:
                return path
        raise LowbitError(
            f"no Hadamard transform fits the attention output ({heads} heads x {head_dim}): "
            f"neither {width} nor {head_dim} has a known construction"
        )
    if not possible[requested]:
        raise LowbitError(
            f"o_proj_hadamard={requested!r} is impossible for {heads} heads x {head_dim}: "
            "a needed Hadamard order has no known construction"
        )
    return requested


def _per_head(head_dim: int):
    """``x ↦ (I ⊗ B) x`` on the last axis, B = H_head_dim/√head_dim, as a float64 function."""

    def apply(x: torch.Tensor) -> torch.Tensor:
        heads = x.reshape(*x.shape[:-1], -1, head_dim)  # [..., H, D]
        return fast_hadamard_transform(heads).reshape(x.shape)

    return apply


def _fuse_value_heads(v_proj: nn.Module, head_dim: int) -> None:
    """v_proj's output ← (I_kv ⊗ B) · output: B applied to each KV head's rows (and bias)."""
    weight = v_proj.weight.detach().to(torch.float64)  # [kv * D, in]
    kv = weight.shape[0] // head_dim
    per_head = weight.reshape(kv, head_dim, -1).transpose(1, 2)  # [kv, in, D]
    mixed = fast_hadamard_transform(per_head).transpose(1, 2)  # [kv, D, in]
    _assign(v_proj.weight, mixed.reshape(weight.shape))
    if v_proj.bias is not None:
        _assign(v_proj.bias, _per_head(head_dim)(v_proj.bias.detach().to(torch.float64)))


def _online_linear(linear: nn.Linear, weight: torch.Tensor, transform: nn.Module) -> nn.Module:
    """An unquantized FakeQuantLinear computing ``transform(x) @ weight^T + b``."""
    weight = weight.to(dtype=linear.weight.dtype, device=linear.weight.device)
    return FakeQuantLinear(
        weight,
        linear.bias,
        input_transform=transform.to(linear.weight.device),
        weight_format="float",
    )


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    """Put ``new`` where ``old`` sits in ``model`` (found by identity, no layer names)."""
    fqn = next(name for name, module in model.named_modules() if module is old)
    replace_module(model, fqn, new)


def _check_plain_linears(adapter: DecoderAdapter) -> None:
    for view in adapter.blocks():
        for name, linear in view.linears().items():
            if type(linear) is not nn.Linear:
                raise LowbitError(
                    f"block {view.index} {name} is a {type(linear).__name__}, not nn.Linear: "
                    "rotate_model must run once, on a float model, before any quantization"
                )


def _check_block(adapter: DecoderAdapter, block: int | None) -> None:
    """A block-diagonal Hadamard of order ``block`` must exist and divide both online widths."""
    if block is None:
        return
    width = adapter.num_heads * adapter.head_dim
    inter = adapter.intermediate_size
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise LowbitError(f"hadamard_block must be a positive integer, got {block!r}")
    if not has_hadamard(block):
        raise LowbitError(f"hadamard_block={block} has no known Hadamard construction")
    if width % block or inter % block:
        raise LowbitError(
            f"hadamard_block={block} must divide the attention width {width} and the "
            f"intermediate size {inter}"
        )


def _add_online_hadamards(
    model: nn.Module, adapter: DecoderAdapter, o_path: str, online_dtype, block: int | None = None
) -> list[LayerRotation]:
    """Online Hadamards on every block's down_proj and o_proj inputs (o_path resolved); with
    ``block``, block-diagonal ones (``I ⊗ H_block``) on both, online (o_path is "full")."""
    inter, heads, head_dim = adapter.intermediate_size, adapter.num_heads, adapter.head_dim
    width = heads * head_dim
    if block is not None:
        return _add_block_hadamards(model, adapter, online_dtype, block)
    down_text = f"online {_describe_hadamard(inter)}, fused into down_proj columns"
    if o_path == "factorized":
        o_text = (
            f"{_describe_hadamard(head_dim)} per head fused into v_proj rows and o_proj; "
            f"online {_describe_hadamard(heads)} across heads"
        )
    elif o_path == "full":
        o_text = f"online {_describe_hadamard(width)}, fused into o_proj columns"
    else:
        o_text = f"{_describe_hadamard(head_dim)} per head fused into v_proj rows and o_proj"

    layers = []
    for view in adapter.blocks():
        with torch.device(view.o_proj.weight.device):  # the block's online modules live with it
            down = OnlineHadamard(inter, compute_dtype=online_dtype)
            down_weight = _rows_transformed(view.down_proj.weight, fast_hadamard_transform)
            _replace(model, view.down_proj, _online_linear(view.down_proj, down_weight, down))

            o_weight = view.o_proj.weight
            if o_path == "full":
                online = OnlineHadamard(width, compute_dtype=online_dtype)
                o_fused = _rows_transformed(o_weight, fast_hadamard_transform)  # W T^T
                _replace(model, view.o_proj, _online_linear(view.o_proj, o_fused, online))
            else:
                _fuse_value_heads(view.v_proj, head_dim)
                fused = _rows_transformed(o_weight, _per_head(head_dim))  # W (I ⊗ B)^T
                if o_path == "factorized":
                    cross = CrossHeadHadamard(heads, head_dim, compute_dtype=online_dtype)
                    cross64 = CrossHeadHadamard(heads, head_dim)
                    fused = cross64(fused)  # W (A ⊗ B)^T
                    _replace(model, view.o_proj, _online_linear(view.o_proj, fused, cross))
                else:
                    _assign(view.o_proj.weight, fused)
        layers.append(LayerRotation(view.index, down_text, o_path, o_text))
    return layers


def _add_block_hadamards(
    model: nn.Module, adapter: DecoderAdapter, online_dtype, block: int
) -> list[LayerRotation]:
    """Block-diagonal online Hadamards ``I ⊗ H_block / sqrt(block)`` before down_proj and
    o_proj: each block of ``block`` input channels is transformed on its own, so a tensor-
    parallel shard of the input (a multiple of ``block`` channels) is transformed without the
    others' channels."""
    inter, width = adapter.intermediate_size, adapter.num_heads * adapter.head_dim
    text = f"block-diagonal {_describe_hadamard(block)}"
    down_text = f"online {text} (x{inter // block}), fused into down_proj columns"
    o_text = f"online {text} (x{width // block}), fused into o_proj columns"
    layers = []
    for view in adapter.blocks():
        with torch.device(view.o_proj.weight.device):
            for linear, n in ((view.down_proj, inter), (view.o_proj, width)):
                online = OnlineHadamard(n, group_size=block, compute_dtype=online_dtype)
                exact = OnlineHadamard(n, group_size=block)  # float64 on a float64 weight
                fused = _rows_transformed(linear.weight, exact)  # W Tᵀ
                _replace(model, linear, _online_linear(linear, fused, online))
        layers.append(LayerRotation(view.index, down_text, "full", o_text))
    return layers


# ---------------------------------------------------------------------------
# Entry point.
# ---------------------------------------------------------------------------


def rotate_model(
    model: nn.Module,
    *,
    rotation: str = "hadamard",
    seed: int = 0,
    online_dtype: torch.dtype | None = None,
    o_proj_hadamard: str = "auto",
    online: bool = True,
    hadamard_block: int | None = None,
) -> RotationReport:
    """QuaRot's function-preserving rewrite, in place: fuse norms, untie, rotate, go online.

    The model computes the same function afterwards (up to float rounding), with
    outlier-free inputs to every linear. down_proj (and o_proj unless the path is
    ``"per_head"``) become unquantized ``FakeQuantLinear``s whose ``input_transform`` a later
    quantizer keeps. Records the report as ``model.lowbit_rotation``.

    Args:
        model: a Hugging Face causal LM of a supported family, not yet quantized or rotated.
        rotation: residual rotation Q: "hadamard" (randomized Hadamard), "random" (Haar
            orthogonal), or "none".
        seed: seed of Q's random signs or Gaussian draw.
        online_dtype: compute dtype of the online Hadamards (None: the activations' dtype;
            the paper's Table 10 compares float16 and float32).
        o_proj_hadamard: "auto", "factorized", "full" or "per_head" (see the module docstring).
        online: add the online Hadamards; False leaves a standard graph (the residual rotation
            with norms fused alone), which is what weight-only formats of other engines
            (GGUF) can hold.
        hadamard_block: make both online Hadamards block-diagonal with blocks of this order
            (must divide the attention width and the intermediate size): what a tensor-parallel
            shard can apply alone, and, for a power of two, what vLLM's Hadamard kernel runs.
            None: full-width transforms (QuaRot's). The o_proj path is then "full".

    Returns:
        A RotationReport.

    Raises:
        LowbitError: bad option, a width with no Hadamard construction (residual: use
            rotation="random"), or a model already rotated or quantized.
    """
    adapter = adapter_for(model)
    if getattr(model, "lowbit_rotation", None) is not None:
        raise LowbitError("this model is already rotated; rotate_model must run only once")
    if (
        rotation == "hadamard"
        and adapter.hidden_size > DENSE_ROTATION_MAX
        and has_hadamard(adapter.hidden_size)
    ):
        q = _randomized_hadamard_map(adapter.hidden_size, seed)  # never forms the n x n matrix
    else:
        device = adapter.lm_head.weight.device
        q = residual_rotation(adapter.hidden_size, rotation, seed=seed, device=device)  # checks
    if hadamard_block is not None and online:
        _check_block(adapter, hadamard_block)
        if o_proj_hadamard not in ("auto", "full"):
            raise LowbitError(
                f"hadamard_block puts a block-diagonal Hadamard online before o_proj; "
                f"o_proj_hadamard={o_proj_hadamard!r} is another path"
            )
        o_path = "full"
    else:
        o_path = _resolve_o_proj_path(adapter, o_proj_hadamard)
    if online_dtype is not None and not (
        isinstance(online_dtype, torch.dtype) and online_dtype.is_floating_point
    ):
        raise LowbitError(f"online_dtype must be a floating torch dtype, got {online_dtype!r}")
    _check_plain_linears(adapter)
    if online and hadamard_block is None and not has_hadamard(adapter.intermediate_size):
        raise LowbitError(
            f"intermediate size {adapter.intermediate_size} has no known Hadamard construction, "
            "so the online down_proj transform cannot be built"
        )
    # Everything is checked: from here on the model is modified.
    untied = untie_embeddings(model)
    norms_fused = fuse_norms(model)
    if q is not None:
        rotate_residual(model, q)
    layers = (
        _add_online_hadamards(model, adapter, o_path, online_dtype, hadamard_block)
        if online
        else []
    )

    if rotation == "hadamard":
        residual = f"randomized Hadamard {_describe_hadamard(adapter.hidden_size)}"
    elif rotation == "random":
        residual = f"random orthogonal {adapter.hidden_size}x{adapter.hidden_size}"
    else:
        residual = "none"
    report = RotationReport(
        rotation=rotation,
        seed=seed,
        hidden_size=adapter.hidden_size,
        residual=residual,
        norms_fused=norms_fused,
        untied=untied,
        online_dtype=None if online_dtype is None else str(online_dtype).removeprefix("torch."),
        o_proj_hadamard=o_path,
        layers=layers,
        hadamard_block=hadamard_block if online else None,
    )
    model.lowbit_rotation = report
    return report
