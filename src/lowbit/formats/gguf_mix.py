"""llama.cpp's file types ("Q4_K_M") as the type of every tensor, by its own rules.

A file type names a mix: a default tensor type, and rules that give some tensors more bits
(``attn_v`` and ``ffn_down`` in some layers, the output matrix), as llama.cpp's quantizer
applies them (``llama_tensor_get_type_impl`` in ``src/llama-quant.cpp``, llama-cpp-python
0.3.36's copy). Then its fallback for rows that a type's block does not divide (SmolLM2's
576-wide rows take no 256-weight super-blocks): Q4_K becomes Q5_0, Q6_K Q8_0, and so on, and
F16 when not even 32 divides the row. The same rules on both sides keep a comparison with
llama.cpp's own files fair.

Layers count as llama.cpp counts them: ``attn_v`` and ``ffn_down`` in layer order, ``n_layers``
of each. The rules of mixture-of-experts models, Falcon, and what llama.cpp calls a 70B model
are not here (lowbit's families are none of them). ``pure`` is llama-quantize's ``--pure``: the
default type everywhere, fallbacks still applied.
"""

from __future__ import annotations

from lowbit.errors import LowbitError

__all__ = ["FILE_TYPES", "TENSORS", "file_type", "tensor_type"]

#: llama.cpp's file types: name -> (``LLAMA_FTYPE_*`` value, default tensor type)
FILE_TYPES: dict[str, tuple[int, str]] = {
    "F32": (0, "F32"),
    "Q4_0": (2, "Q4_0"),
    "Q4_1": (3, "Q4_1"),
    "Q8_0": (7, "Q8_0"),
    "Q5_0": (8, "Q5_0"),
    "Q5_1": (9, "Q5_1"),
    "Q2_K": (10, "Q2_K"),
    "Q3_K_S": (11, "Q3_K"),
    "Q3_K_M": (12, "Q3_K"),
    "Q3_K_L": (13, "Q3_K"),
    "Q4_K_S": (14, "Q4_K"),
    "Q4_K_M": (15, "Q4_K"),
    "Q5_K_S": (16, "Q5_K"),
    "Q5_K_M": (17, "Q5_K"),
    "Q6_K": (18, "Q6_K"),
    "IQ4_NL": (25, "IQ4_NL"),
}
#: llama-quantize's aliases
_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}
#: ``tensor_type_fallback``: a 256-weight type on rows it does not divide
_FALLBACK = {"Q2_K": "Q4_0", "Q3_K": "Q4_0", "Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}
_SUPER = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
#: the tensors of a decoder, by llama.cpp's names
TENSORS = ("token_embd", "output", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
           "ffn_up", "ffn_down")  # fmt: skip


def file_type(name: str) -> str:
    """The canonical file type name (aliases resolved); one sentence for an unknown one."""
    key = str(name).upper()
    key = _ALIASES.get(key, key)
    if key not in FILE_TYPES:
        known = ", ".join(n for n in FILE_TYPES if n != "F32")
        raise LowbitError(f"unknown GGUF file type {name!r}; the types are {known}")
    return key


def _block(type_name: str) -> int:
    return 256 if type_name in _SUPER else 32


def _more_bits(layer: int, n_layers: int) -> bool:
    """llama.cpp's ``use_more_bits``: the first and last eighth, and every third between."""
    eighth = n_layers // 8
    return layer < eighth or layer >= 7 * n_layers // 8 or (layer - eighth) % 3 == 2


def _mix(ftype: str, default: str, tensor: str, layer: int, n_layers: int, n_gqa: int,
         width: int, tied: bool, imatrix: bool) -> str:  # fmt: skip
    """``llama_tensor_get_type_impl`` for lowbit's families (before the fallback)."""
    if tensor == "output" or (tied and tensor == "token_embd"):
        if width % _block(default):
            return "Q8_0"
        return default if default == "Q8_0" else "Q6_K"
    new = default
    if tensor == "attn_v":
        if ftype == "Q2_K":
            new = "Q4_K" if n_gqa >= 4 else "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if layer < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype == "IQ4_NL" and n_gqa >= 4:
            new = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _more_bits(layer, n_layers):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and layer < 4:
            new = "Q5_K"
    elif tensor == "ffn_down":
        if ftype == "Q2_K":
            new = "Q3_K"
        elif ftype == "Q3_K_M":
            new = "Q5_K" if layer < n_layers // 16 else "Q4_K"
        elif ftype == "Q3_K_L":
            new = "Q5_K"
        elif ftype == "Q4_K_M":
            new = "Q6_K" if _more_bits(layer, n_layers) else new
        elif layer < n_layers // 8 and ftype == "IQ4_NL" and not imatrix:
            new = "Q5_K"
        elif ftype == "Q5_K_M" and _more_bits(layer, n_layers):
            new = "Q6_K"
        elif ftype == "Q4_K_S" and layer < n_layers // 8:
            new = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and imatrix and layer < n_layers // 8:
            new = "Q4_1" if ftype == "Q4_0" else "Q5_1"
    elif tensor == "attn_output":
        new = {"Q2_K": "Q3_K", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K"}.get(ftype, new)
    return new


def tensor_type(
    ftype: str,
    tensor: str,
    *,
    layer: int = 0,
    n_layers: int = 1,
    n_gqa: int = 1,
    width: int,
    tied: bool = True,
    pure: bool = False,
    imatrix: bool = False,
) -> str:
    """The type llama.cpp's quantizer gives one tensor of a ``ftype`` file.

    Args:
        ftype: a file type name (:data:`FILE_TYPES`, or an alias such as ``Q4_K``).
        tensor: one of :data:`TENSORS`.
        layer, n_layers: the tensor's block and the number of blocks.
        n_gqa: attention heads per key-value head.
        width: the tensor's row length (a linear's input features).
        tied: the output matrix is the token embedding (the file has no ``output.weight``).
        pure: llama-quantize's ``--pure``.
        imatrix: the rules of a file quantized with an importance matrix.

    Returns:
        A type name: one of lowbit's GGUF grids, ``F32`` (an F32 file) or ``F16`` (rows no
        block divides).
    """
    ftype = file_type(ftype)
    if tensor not in TENSORS:
        raise LowbitError(f"unknown GGUF tensor {tensor!r}; the tensors are {', '.join(TENSORS)}")
    default = FILE_TYPES[ftype][1]
    if default == "F32":
        return "F32"
    new = default
    if not pure:
        new = _mix(ftype, default, tensor, layer, n_layers, n_gqa, width, tied, imatrix)
    if width % _block(new):
        new = _FALLBACK.get(new, new)
        if width % _block(new):
            new = "F16"
    return new
