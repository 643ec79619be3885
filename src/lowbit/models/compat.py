"""What differs between the transformers releases lowbit supports (``>=5,<6``), in one place.

transformers 5.24 renamed the KV cache argument of every model, decoder layer and attention
``forward`` from ``past_key_values`` to ``cache`` (the old name stays accepted, with a
FutureWarning, until 5.40). A decoder layer of 5.23 calls its attention with
``past_key_values=``, one of 5.24 with ``cache=``; an attention forward that lowbit installs
(:class:`lowbit.kv.attention.KVQuantAttention`, K-sort's ordered-RoPE forward) must find the
cache under either name, or it silently runs without one.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

__all__ = ["pop_attention_cache", "CACHE_KWARG"]


def _cache_kwarg() -> str:
    major, minor = (int(part) for part in version("transformers").split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


#: the name under which this transformers' models (and ``generate``) take a KV cache
CACHE_KWARG = _cache_kwarg()


def pop_attention_cache(kwargs: dict[str, Any]) -> Any:
    """Remove the KV cache from an attention forward's keyword arguments and return it.

    Args:
        kwargs: the ``**kwargs`` a decoder layer passed to its attention; ``cache`` (transformers
            >= 5.24) and ``past_key_values`` (earlier) are both removed, so neither reaches the
            attention kernel.

    Returns:
        The ``transformers.Cache`` under whichever name it came, or None (no cache). A cache is
        tested with ``is not None``: an empty ``Cache`` has length 0 and is falsy.
    """
    cache = kwargs.pop("cache", None)
    legacy = kwargs.pop("past_key_values", None)
    return cache if cache is not None else legacy
