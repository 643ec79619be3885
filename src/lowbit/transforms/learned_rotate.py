"""Learnable rotations on top of QuaRot's (SpinQuant's R1 and R2), and their exact fusion.

On a model that :func:`~lowbit.transforms.rotate.rotate_model` rotated (residual stream by
``Q0``, online Hadamards before down_proj and o_proj), two more orthogonal transforms keep the
function and change only what the quantizers see:

* **R1** [hidden, hidden] on the residual stream: the total residual rotation becomes ``Q0 R1``
  (``R1 = I`` is QuaRot's randomized Hadamard). It is fused by
  :func:`~lowbit.transforms.rotate.rotate_residual`.
* **R2** [head_dim, head_dim] per layer, shared by all heads (so GQA stays consistent): values
  become ``v R2`` per head (v_proj's rows, ``W_v,h ← R2ᵀ W_v,h``), which attention carries to
  the o_proj input, whose weight takes ``D = I_heads ⊗ R2`` ahead of its online transform T:
  ``W ← W Tᵀ D T`` (row vectors; ``T = I`` where o_proj has none). Its base is the per-head
  Hadamard B when QuaRot's o_proj path is ``"full"`` (values are not rotated there), else I.

Optionally, a third transform that is not a rotation:

* **S** [L, intermediate], a positive scale per channel of each down_proj input (the smoothing
  that FlatQuant and OSTQuant learn beside their rotations): down_proj's input becomes
  ``x / s`` ahead of its online transform T (up_proj's rows divided by s, exact because the
  gate multiplies up's output channel by channel) and its weight ``W ← (W Tᵀ diag(s)) T``.
  Down_proj's input is a point R1 and R2 do not reach; S trades its large channels' share of
  the per-token scale against the error its weight columns then amplify. Free at inference.

And optionally corrections to the weights themselves:

* **ΔW** per block linear, added to its weight as the training loop sees it (after S, for
  down_proj): the weights learn to absorb what the activation and value quantizers lose,
  distilled from the float model (quantization-aware fine-tuning with the quantizers of the
  deployed model in the loop, as FlatQuant and EfficientQAT train block weights). Fused into
  the weights before R1 and R2, so they too are free at inference.

R1 and R2 are the Cayley transform of a free parameter, ``R = base · (I + A)⁻¹ (I - A)`` with
``A = X - Xᵀ``: every value of X gives an exactly orthogonal R (to float rounding; fusion
evaluates it in float64), so any torch optimizer trains X with no retraction step and the
training state is X and the optimizer's own state. X = 0 is QuaRot's model.

:func:`quantized_in_rotated_basis` shows a training loop the quantization points of the fused
model without fusing: each point's input is rotated, quantized by the caller's function and
rotated back, so the network runs in QuaRot's basis and the gradient reaches R through the
rotated-back error; given a weight quantizer, each block linear's weight is likewise taken to
the fused basis, quantized per row there and rotated back (a parametrization of the weight,
removed on exit). Nothing here quantizes; the caller passes the quantizers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn
from torch.nn.utils import parametrize

from lowbit.errors import LowbitError
from lowbit.models.adapter import DecoderAdapter, adapter_for
from lowbit.transforms.hadamard import has_hadamard, random_hadamard_matrix
from lowbit.transforms.rotate import _assign, rotate_residual

__all__ = [
    "ACTIVATION_POINTS",
    "LearnedRotations",
    "cayley",
    "fuse_learned_rotations",
    "head_base_for",
    "input_transform_matrix",
    "quantized_in_rotated_basis",
]

Quantizer = Callable[[Tensor], Tensor]
#: ``activation(x, layer, point)``: a quantization point's input quantized
PointQuantizer = Callable[[Tensor, int, str], Tensor]

#: each kind of activation quantization point of a block -> the linears whose input it is
ACTIVATION_POINTS = {
    "qkv": ("q_proj", "k_proj", "v_proj"),  # the input norm's output
    "gate_up": ("gate_proj", "up_proj"),  # the post-attention norm's output
    "o_proj": ("o_proj",),
    "down_proj": ("down_proj",),  # after its online transform
}


def cayley(x: Tensor) -> Tensor:
    """The orthogonal ``(I + A)⁻¹ (I - A)``, ``A = X - Xᵀ``, for X [..., n, n]."""
    a = x - x.transpose(-1, -2)  # [..., n, n] skew-symmetric
    eye = torch.eye(x.shape[-1], dtype=x.dtype, device=x.device).expand_as(a)
    return torch.linalg.solve(eye + a, eye - a)


class LearnedRotations(nn.Module):
    """R1 and (optionally) one R2 per layer, as Cayley transforms of free parameters, and
    (optionally) down_proj's input scales S, as the exponential of free parameters.

    Args:
        hidden_size: residual width (R1 is hidden × hidden).
        head_dim: R2's size.
        num_layers: number of R2s.
        heads: learn R2 (False: values and the o_proj input are left as QuaRot has them).
        head_base: R2's base [head_dim, head_dim] (None: the identity).
        down_width: down_proj's input width, to learn S (0: S is not learned).
        weight_shapes: ``{key: shape}`` of the block linears whose weights get a learned
            correction ΔW (keys ``"{layer}_{linear}"``; None: the weights are not learned).
        device: where the parameters are made (the model's device).
    """

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_layers: int,
        *,
        heads: bool = True,
        head_base: Tensor | None = None,
        down_width: int = 0,
        weight_shapes: dict[str, torch.Size] | None = None,
        device: torch.device | None = None,
    ):
        super().__init__()
        zeros = torch.zeros(hidden_size, hidden_size, device=device)
        self.residual_param = nn.Parameter(zeros)  # X1 [n, n]
        shape = (num_layers, head_dim, head_dim) if heads else (0, head_dim, head_dim)
        self.head_params = nn.Parameter(torch.zeros(shape, device=device))  # X2 [L, D, D]
        shape = (num_layers if down_width else 0, down_width)
        self.down_log_scales = nn.Parameter(torch.zeros(shape, device=device))  # log S [L, I]
        if head_base is None:
            head_base = torch.eye(head_dim, dtype=torch.float64, device=device)
        base = head_base.to(device=device, dtype=torch.float64)
        self.register_buffer("head_base", base, persistent=False)  # [D, D]
        self.weight_deltas = nn.ParameterDict(
            {key: torch.zeros(shape, device=device) for key, shape in (weight_shapes or {}).items()}
        )  # ΔW [out, in] per block linear

    @classmethod
    def for_model(
        cls,
        adapter: DecoderAdapter,
        o_proj_path: str,
        *,
        heads: bool = True,
        scales: bool = False,
        weights: bool = False,
        seed: int = 0,
    ) -> LearnedRotations:
        """Transforms for a model QuaRot has rotated (``o_proj_path``: its report's
        ``o_proj_hadamard``), starting at the identity on top of QuaRot's rotation, on the
        model's device; ``scales``: learn S too; ``weights``: learn ΔW for every block
        linear."""
        device = adapter.embed_tokens.weight.device
        shapes = None
        if weights:
            shapes = {
                _weight_key(view.index, name): linear.weight.shape
                for view in adapter.blocks()
                for linear, name in _block_linears(view)
            }
        return cls(
            adapter.hidden_size,
            adapter.head_dim,
            adapter.num_layers,
            heads=heads,
            head_base=head_base_for(adapter, o_proj_path, seed=seed, device=device),
            down_width=adapter.intermediate_size if scales else 0,
            weight_shapes=shapes,
            device=device,
        )

    @property
    def learns_heads(self) -> bool:
        return self.head_params.shape[0] > 0

    @property
    def learns_scales(self) -> bool:
        return self.down_log_scales.shape[0] > 0

    @property
    def learns_weights(self) -> bool:
        return len(self.weight_deltas) > 0

    def rotation_parameters(self) -> list[nn.Parameter]:
        """The Cayley parameters (X1, X2), apart from S's and ΔW."""
        return [self.residual_param, self.head_params]

    def residual(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """R1 [hidden, hidden]."""
        return cayley(self.residual_param.to(dtype))

    def heads(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """R2 per layer [L, head_dim, head_dim] (empty when R2 is not learned)."""
        return self.head_base.to(dtype) @ cayley(self.head_params.to(dtype))

    def down_scales(self, dtype: torch.dtype = torch.float32) -> Tensor:
        """S per layer [L, intermediate] (empty when S is not learned)."""
        return self.down_log_scales.to(dtype).exp()


def _exact_transform(linear: nn.Module) -> nn.Module | None:
    """The linear's online transform computing in its input's dtype (None: it has none)."""
    transform = getattr(linear, "input_transform", None)
    if transform is None:
        return None
    exact = type(transform).from_spec({**transform.spec(), "compute_dtype": None})
    return exact.to(linear.weight.device)


def input_transform_matrix(linear: nn.Module, width: int) -> Tensor:
    """The online transform ahead of a linear as a float64 matrix T [width, width]
    (``x ↦ x T``); the identity where it has none (QuaRot's per-head o_proj path, a standard
    graph)."""
    eye = torch.eye(width, dtype=torch.float64, device=linear.weight.device)
    transform = _exact_transform(linear)
    return eye if transform is None else transform(eye)  # row i: e_i T


def head_base_for(
    adapter: DecoderAdapter, o_proj_path: str, *, seed: int = 0, device=None
) -> Tensor | None:
    """R2's base: a randomized per-head Hadamard [D, D] float64 where QuaRot leaves values
    unrotated (o_proj path ``"full"``), else None (the identity)."""
    if o_proj_path == "full" and has_hadamard(adapter.head_dim):
        return random_hadamard_matrix(adapter.head_dim, seed=seed, device=device)
    return None


def _per_head(x: Tensor, r2: Tensor) -> Tensor:
    """``x`` [..., heads · D] with every head multiplied by R2 [D, D] on the right."""
    heads = x.reshape(*x.shape[:-1], -1, r2.shape[0])  # [..., H, D]
    return (heads @ r2).reshape(x.shape)


def _check_rotated(model: nn.Module) -> DecoderAdapter:
    if getattr(model, "lowbit_rotation", None) is None:
        raise LowbitError("learned rotations go on a model rotate_model has rotated first")
    return adapter_for(model)


@contextlib.contextmanager
def quantized_in_rotated_basis(
    model: nn.Module,
    rotations: LearnedRotations,
    *,
    activation: PointQuantizer | None,
    value: Quantizer | None,
    weight: Quantizer | None = None,
) -> Iterator[Callable[[], contextlib.AbstractContextManager]]:
    """While inside, the model computes as if R1 and R2 were fused and its quantization points
    quantized, without changing a weight. Yields ``paused``: inside ``with paused():`` the
    model is the float model again (a loss's reference pass), the hooks staying in place.

    Points: the inputs of q/k/v and gate/up (the two norms' outputs, in R1's basis), of o_proj
    (``T(o D)``) and of down_proj (its online transform's output), by ``activation``; values
    per head (``v R2``, [..., D]) by ``value``. Each is rotated, quantized and rotated back.
    With S, down_proj's input is divided by it and its weight takes S as the fused one does
    (the exact online transform of ``W Tᵀ diag(s)``'s rows). With ΔW, every block linear
    multiplies ``W + ΔW`` (W after S). R1, R2 and S are recomputed from the parameters on each
    forward pass, so a loss backpropagates into them. Hooks are removed on exit.

    Args:
        model: a model rotated by ``rotate_model`` (online transforms in place), in float.
        rotations: the learnable transforms.
        activation: quantizer of a linear's input, ``activation(x, layer, point)`` with x
            [..., features] and point a key of :data:`ACTIVATION_POINTS` (None: off).
        value: quantizer of one head's values, ``[..., D] -> same`` (None: off).
        weight: quantizer of a block linear's weight ``[out, in]`` as the fused model holds it
            (rows quantized in R1's and R2's basis, then rotated back), or None (float
            weights, as for GPTQ afterwards).
    """
    adapter = _check_rotated(model)
    width = adapter.num_heads * adapter.head_dim
    state: dict = {"paused": False}
    handles = []

    @contextlib.contextmanager
    def paused() -> Iterator[None]:  # the float model: every point and weight left as it is
        state["paused"] = True
        try:
            yield
        finally:
            state["paused"] = False

    def refresh(module, args):  # once per forward pass, before block 0
        state["r1"] = rotations.residual()
        if rotations.learns_heads:
            state["r2"] = rotations.heads()
        if rotations.learns_scales:
            state["s"] = rotations.down_scales()

    def residual_point(index: int, point: str):
        def hook(module, args, out):  # norm output [B, S, hidden]
            if state["paused"]:
                return None
            r1 = state["r1"]
            return activation(out @ r1, index, point) @ r1.T

        return hook

    def value_point(index: int):
        def hook(module, args, out):  # v_proj output [B, S, kv · D]
            if state["paused"]:
                return None
            r2 = state["r2"][index] if rotations.learns_heads else None
            heads = out.reshape(*out.shape[:-1], -1, adapter.head_dim)  # [B, S, kv, D]
            if r2 is None:
                return value(heads).reshape(out.shape)
            return (value(heads @ r2) @ r2.T).reshape(out.shape)

        return hook

    def o_point(index: int, t: Tensor):
        def hook(module, args):  # o_proj input [B, S, heads · D]
            if state["paused"]:
                return None
            (o,) = args
            r2 = state["r2"][index] if rotations.learns_heads else None
            rotated = (o if r2 is None else _per_head(o, r2)) @ t  # what the fused o_proj sees
            back = activation(rotated, index, "o_proj") @ t.T
            return (back if r2 is None else _per_head(back, r2.T),)  # o_proj applies T itself

        return hook

    def scaled_input(index: int):
        def hook(module, args):  # down_proj input [B, S, I], before its online transform
            return None if state["paused"] else (args[0] / state["s"][index],)

        return hook

    saved, parametrized = {}, set()
    refresh(model, ())  # the parametrizations below are evaluated once when registered
    try:
        handles.append(model.register_forward_pre_hook(refresh))
        for view in adapter.blocks():
            down = view.down_proj
            if rotations.learns_scales:  # first: the quantizers below see the scaled input
                handles.append(down.register_forward_pre_hook(scaled_input(view.index)))
                parametrize.register_parametrization(
                    down, "weight", _ScaledDown(down, state, view.index)
                )
                parametrized.add(down)
            if activation is not None or weight is not None:
                t = input_transform_matrix(view.o_proj, width).float()  # [W, W]
            if activation is not None:
                norms = (view.input_norm, "qkv"), (view.post_attention_norm, "gate_up")
                for norm, point in norms:
                    handles.append(norm.register_forward_hook(residual_point(view.index, point)))
                handles.append(view.o_proj.register_forward_pre_hook(o_point(view.index, t)))
                quantize = _FunctionModule(
                    lambda x, i=view.index: x if state["paused"] else activation(x, i, "down_proj")
                )
                if hasattr(down, "act_quantizer"):  # after its online transform
                    saved[down] = down.act_quantizer
                    down.act_quantizer = quantize
                else:  # a plain linear (no online transform): its input is what it multiplies
                    handles.append(
                        down.register_forward_pre_hook(lambda m, args, q=quantize: (q(args[0]),))
                    )
            if value is not None:
                handles.append(view.v_proj.register_forward_hook(value_point(view.index)))
            for linear, name in _block_linears(view):
                if rotations.learns_weights:  # after S: ΔW is in the basis the loop multiplies
                    delta = _WeightDelta(rotations, _weight_key(view.index, name), state)
                    parametrize.register_parametrization(linear, "weight", delta)
                    parametrized.add(linear)
                if weight is not None:
                    fused = _FusedWeight(weight, state, _WEIGHT_SIDES[name], view.index, t)
                    parametrize.register_parametrization(linear, "weight", fused)
                    parametrized.add(linear)
        yield paused
    finally:
        for handle in handles:
            handle.remove()
        for module, quantizer in saved.items():
            module.act_quantizer = quantizer
        for linear in parametrized:
            parametrize.remove_parametrizations(linear, "weight", leave_parametrized=False)


#: each block linear -> how the fused model rotates its weight
_WEIGHT_SIDES = {"q_proj": "input", "k_proj": "input", "v_proj": "value", "gate_proj": "input",
                 "up_proj": "input", "o_proj": "o_proj", "down_proj": "output"}  # fmt: skip


def _weight_key(index: int, name: str) -> str:
    """ΔW's key for block ``index``'s linear ``name`` (e.g. ``"3_q_proj"``)."""
    return f"{index}_{name}"


def _block_linears(view) -> list[tuple[nn.Module, str]]:
    """Each block linear with its name."""
    return [(getattr(view, name), name) for name in _WEIGHT_SIDES]


class _FusedWeight(nn.Module):
    """A weight ``[out, in]`` in QuaRot's basis mapped to the fused model's (R1 on the input
    side of q/k/v/gate/up and the output side of o_proj/down_proj, R2 on v's rows and per head
    on o_proj's input through its online transform T), quantized there, and mapped back."""

    def __init__(self, quantize: Quantizer, state: dict, side: str, index: int, t: Tensor):
        super().__init__()
        self.quantize, self.state, self.side, self.index = quantize, state, side, index
        self.register_buffer("t", t, persistent=False)  # [W, W] (o_proj)

    def forward(self, w: Tensor) -> Tensor:
        if self.state["paused"]:
            return w
        r1 = self.state["r1"]
        r2 = self.state["r2"][self.index] if "r2" in self.state else None
        if self.side == "input" or (self.side == "value" and r2 is None):
            return self.quantize(w @ r1) @ r1.T
        if self.side == "output":
            return r1 @ self.quantize(r1.T @ w)
        if self.side == "value":
            heads = w.reshape(-1, r2.shape[0], w.shape[1])  # [kv, D, in]
            fused = (r2.T @ heads @ r1).reshape(w.shape)
            back = r2 @ self.quantize(fused).reshape(heads.shape) @ r1.T
            return back.reshape(w.shape)
        inner = w @ self.t.T if r2 is None else _per_head(w @ self.t.T, r2)  # o_proj
        fused = r1.T @ (inner @ self.t)
        back = (r1 @ self.quantize(fused)) @ self.t.T
        return (back if r2 is None else _per_head(back, r2.T)) @ self.t


class _WeightDelta(nn.Module):
    """A block linear's weight plus its learned correction ΔW (the float weight when paused).
    ΔW is looked up in ``rotations`` each time, not held: it stays the optimizer's one
    parameter."""

    def __init__(self, rotations: LearnedRotations, key: str, state: dict):
        super().__init__()
        self.lookup = lambda: rotations.weight_deltas[key]  # not a submodule
        self.state = state

    def forward(self, w: Tensor) -> Tensor:
        return w if self.state["paused"] else w + self.lookup()


class _ScaledDown(nn.Module):
    """down_proj's weight for an input divided by S, ``(W Tᵀ diag(s)) T``, with ``W Tᵀ`` (the
    weight in the basis ahead of the online transform T) taken once: the weights are frozen."""

    def __init__(self, down: nn.Module, state: dict, index: int):
        super().__init__()
        self.state, self.index = state, index
        weight = down.weight.detach()  # [out, I]
        t = input_transform_matrix(down, weight.shape[1])  # [I, I]
        self.register_buffer("base", (weight.double() @ t.T).to(weight.dtype), persistent=False)
        self.transform = _exact_transform(down)

    def forward(self, w: Tensor) -> Tensor:
        if self.state["paused"]:
            return w
        scaled = self.base * self.state["s"][self.index]  # [out, I]
        return scaled if self.transform is None else self.transform(scaled)


class _FunctionModule(nn.Module):
    """A function in a module slot (a linear's ``act_quantizer``) while training."""

    def __init__(self, function: Quantizer):
        super().__init__()
        self.function = function

    def forward(self, x: Tensor) -> Tensor:
        return self.function(x)


@torch.no_grad()
def fuse_learned_rotations(model: nn.Module, rotations: LearnedRotations) -> None:
    """Fuse ΔW, R1, R2 and S into the weights, in place (float64 products): the model keeps
    QuaRot's structure and online transforms, and computes the same function.

    Args:
        model: the model ``rotate_model`` rotated, still in float.
        rotations: the transforms to fuse (evaluated in float64).
    """
    adapter = _check_rotated(model)
    device = adapter.lm_head.weight.device
    scales = rotations.down_scales(torch.float64).to(device)  # [L, I] or empty
    if rotations.learns_scales:  # S acts on up's rows and down's columns: it commutes with R1
        _fuse_down_scales(adapter, scales)
    if rotations.learns_weights:
        _fold_weight_deltas(adapter, rotations, scales)
    rotate_residual(model, rotations.residual(torch.float64).to(device))
    if not rotations.learns_heads:
        return
    head_dim, width = adapter.head_dim, adapter.num_heads * adapter.head_dim
    r2s = rotations.heads(torch.float64).to(device)  # [L, D, D]
    for view in adapter.blocks():
        r2 = r2s[view.index]
        v_weight = view.v_proj.weight.detach().to(torch.float64)  # [kv · D, in]
        per_head = v_weight.reshape(-1, head_dim, v_weight.shape[1])  # [kv, D, in]
        _assign(view.v_proj.weight, (r2.T @ per_head).reshape(v_weight.shape))  # v ← v R2
        if view.v_proj.bias is not None:
            _assign(view.v_proj.bias, _per_head(view.v_proj.bias.detach().double(), r2))
        t = input_transform_matrix(view.o_proj, width)  # [W, W]
        o_weight = view.o_proj.weight.detach().to(torch.float64)  # [out, W]
        _assign(view.o_proj.weight, _per_head(o_weight @ t.T, r2) @ t)  # W Tᵀ D T


def _fold_weight_deltas(adapter: DecoderAdapter, rotations: LearnedRotations, scales: Tensor):
    """Add each ΔW to its weight once S is fused and before R1 is (float64), as the loop added
    it: down_proj's after S, up_proj's ahead of S's division of its rows."""
    for view in adapter.blocks():
        for linear, name in _block_linears(view):
            delta = rotations.weight_deltas[_weight_key(view.index, name)].detach().double()
            if name == "up_proj" and rotations.learns_scales:
                delta = delta / scales[view.index][:, None]  # [I, hidden]
            _assign(linear.weight, linear.weight.detach().double() + delta)


def _fuse_down_scales(adapter: DecoderAdapter, scales: Tensor) -> None:
    """Divide each up_proj's rows by S [L, I] and give down_proj the weight
    ``(W Tᵀ diag(s)) T`` (float64)."""
    for view, s in zip(adapter.blocks(), scales, strict=True):
        up, down = view.up_proj, view.down_proj
        _assign(up.weight, up.weight.detach().double() / s[:, None])  # [I, hidden]
        if up.bias is not None:
            _assign(up.bias, up.bias.detach().double() / s)
        t = input_transform_matrix(down, s.shape[0])  # [I, I]
        _assign(down.weight, (down.weight.detach().double() @ t.T * s) @ t)
