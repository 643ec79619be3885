"""Settings as JSON: one way to describe the fields of what a checkpoint stores, and check them.

Every object a checkpoint rebuilds from JSON (a runtime module's spec, a KV quantizer's
``to_dict()``, a recipe's settings) describes its fields with Python annotations: a recipe by
its dataclass fields, a KV quantizer by its constructor's signature, a runtime module by its
``spec_fields`` (:mod:`lowbit.nn.spec`), which are annotations too. :func:`check_fields` checks
values read from a file against them, so a damaged or edited checkpoint is one sentence, never
a traceback deep inside a constructor; :func:`parse_text` reads a value typed on the command
line (``--set key=value``) by the same annotation. Ranges beyond these types (bits 2-8) are
each object's own ``validate``.

What an annotation admits in JSON: ``int`` a positive integer (a size), :data:`Count` an
integer >= 0 (a number of things, possibly none), ``float`` a finite number, ``bool``, ``str``,
``torch.dtype`` the name of one (``"float16"``), ``Literal[...]`` one of its values, ``list`` a
list, ``X | None`` also null. A bool is never an integer.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import types
import typing
from typing import Any, Literal, NewType, Union

import torch

from lowbit.errors import LowbitError

__all__ = [
    "Count",
    "field_annotations",
    "admits",
    "check_fields",
    "parse_text",
    "dtype_name",
    "dtype_from_name",
]

#: an integer that may be 0 (a count: outliers, 4-bit groups); plain ``int`` fields are sizes >= 1
Count = NewType("Count", int)


def field_annotations(obj: Any) -> dict[str, Any]:
    """The fields of a dataclass, or the named parameters of a callable, with their annotations
    (``self``, ``*args`` and ``**kwargs`` left out)."""
    if dataclasses.is_dataclass(obj):
        hints = typing.get_type_hints(obj)
        return {f.name: hints[f.name] for f in dataclasses.fields(obj)}
    hints = typing.get_type_hints(obj)
    return {
        name: hints.get(name, Any)
        for name, p in inspect.signature(obj).parameters.items()
        if name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    }


def admits(annotation: Any, value: Any) -> bool:
    """Whether the JSON ``value`` is a valid value of a field annotated ``annotation``."""
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        return any(admits(option, value) for option in typing.get_args(annotation))
    if origin is Literal:
        return value in typing.get_args(annotation)
    if origin is list or annotation is list:
        return isinstance(value, list)
    if annotation is type(None) or annotation is None:
        return value is None
    if annotation is bool:
        return isinstance(value, bool)
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if annotation is Count:
        return is_int and value >= 0
    if annotation is int:
        return is_int and value >= 1
    if annotation is float:
        return (is_int or isinstance(value, float)) and math.isfinite(value)
    if annotation is str:
        return isinstance(value, str)
    if annotation is torch.dtype:
        return isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype)
    return False


def check_fields(
    values: Any, fields: dict[str, Any], what: str, *, optional: tuple[str, ...] = ()
) -> None:
    """Raise LowbitError unless ``values`` is a dict with exactly ``fields`` (those named in
    ``optional`` may be absent; a ``"class"`` or ``"kind"`` key naming the entry is ignored),
    each value admitted by its annotation."""
    if not isinstance(values, dict):
        raise LowbitError(f"the checkpoint's {what} entry is not a JSON object")
    given = set(values) - {"class", "kind"}
    missing = sorted(set(fields) - given - set(optional))
    extra = sorted(given - set(fields))
    if missing or extra:
        wrong = "missing " + ", ".join(missing) if missing else "unknown " + ", ".join(extra)
        raise LowbitError(f"the checkpoint's {what} entry has fields wrong ({wrong})")
    for key in sorted(given):
        if not admits(fields[key], values[key]):
            raise LowbitError(
                f"the checkpoint's {what} entry has an invalid {key}: {values[key]!r}"
            )


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{text!r} is not a boolean (use true or false)")


def parse_text(text: Any, annotation: Any) -> Any:
    """A value typed as text (``--set w_bits=4``) as the field's annotated type; a value that
    is not a string is returned as it is. Raises ValueError with the reason."""
    if not isinstance(text, str):
        return text
    origin = typing.get_origin(annotation)
    if origin in (Union, types.UnionType):
        options = typing.get_args(annotation)
        if type(None) in options and text.strip().lower() in ("none", "null", ""):
            return None
        errors = []
        for option in options:
            if option is type(None):
                continue
            try:
                return parse_text(text, option)
            except ValueError as err:
                errors.append(str(err))
        raise ValueError("; ".join(errors))
    if origin is Literal:
        if text not in typing.get_args(annotation):
            raise ValueError(f"{text!r} is not one of {list(typing.get_args(annotation))}")
        return text
    if annotation is bool:
        return _parse_bool(text)
    if annotation in (int, Count):
        return int(text)
    if annotation is float:
        value = float(text)
        if not math.isfinite(value):
            raise ValueError(f"{text.strip()!r} is not a finite number")
        return value
    if annotation is str:
        return text
    raise ValueError(f"cannot read a value of type {annotation} from text")


def dtype_name(dtype: torch.dtype | None) -> str | None:
    """``torch.float16`` -> ``"float16"`` (how specs store dtypes)."""
    return None if dtype is None else str(dtype).removeprefix("torch.")


def dtype_from_name(name: str | None) -> torch.dtype | None:
    """``"float16"`` -> ``torch.float16``; a name that is not a dtype is a LowbitError."""
    if name is None:
        return None
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise LowbitError(f"{name!r} is not a torch dtype")
    return dtype
