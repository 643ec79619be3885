"""Text generation with a (quantized) model: ``generate(model, tokenizer, prompt, ...)``.

A thin layer over transformers' ``model.generate``: it builds the model's own KV cache (the
recipe's quantized cache when one was installed, ``model.lowbit_make_cache()``), streams text
through a ``TextStreamer`` to a callback, and measures prefill and decode apart, since a
quantized model's cost shows in the decode steps.
"""

from __future__ import annotations

import copy
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from transformers import TextStreamer

from lowbit.errors import LowbitError
from lowbit.models.compat import CACHE_KWARG
from lowbit.models.run import prepare_layouts


@dataclass
class GenerationResult:
    """What one ``generate`` call produced and what it cost.

    ``tokens_per_second`` is over the decode steps only: the tokens after the first one,
    divided by the time from the first to the last (the first token's time is the prefill,
    which is proportional to the prompt, not to the answer).
    """

    text: str  # the new tokens decoded (special tokens skipped)
    new_tokens: list[int]
    prompt_tokens: int
    prefill_seconds: float  # from the call to the first new token
    decode_seconds: float  # from the first new token to the last
    tokens_per_second: float | None  # None when fewer than 2 tokens were generated
    peak_memory_bytes: int | None
    peak_memory_kind: str  # what peak_memory_bytes measures
    cache: object = field(repr=False)  # the KV cache the model generated with
    streamed: str = ""  # the text as the streamer handed it out, piece by piece

    @property
    def cache_type(self) -> str:
        return type(self.cache).__name__


class TimedStreamer(TextStreamer):
    """A ``TextStreamer`` that hands finished text to a callback and times each new token."""

    def __init__(self, tokenizer, callback: Callable[[str], None] | None = None) -> None:
        super().__init__(tokenizer, skip_prompt=True, skip_special_tokens=True)
        self.callback = callback
        self.token_times: list[float] = []
        self.pieces: list[str] = []

    def put(self, value: torch.Tensor) -> None:
        if not self.next_tokens_are_prompt:  # a new token (the first put is the prompt)
            self.token_times.append(time.perf_counter())
        super().put(value)

    def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
        if text:
            self.pieces.append(text)
            if self.callback is not None:
                self.callback(text)


def check_sampling(
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    *,
    names: tuple[str, str, str] = ("max_new_tokens", "temperature", "top_p"),
) -> None:
    """Refuse, with one sentence, generation settings that mean nothing: fewer than one new
    token, a temperature that is negative, infinite or NaN, a top-p outside (0, 1].

    Args:
        names: how the sentence names the three settings (the CLI passes its options').
    """
    if max_new_tokens < 1:
        raise LowbitError(f"{names[0]} must be at least 1, not {max_new_tokens}")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise LowbitError(
            f"{names[1]} must be 0 (greedy) or a finite number more than 0, not {temperature}"
        )
    if not 0 < top_p <= 1:  # NaN fails this too
        raise LowbitError(f"{names[2]} must be more than 0 and at most 1, not {top_p}")


def check_text(text: str, what: str) -> None:
    """Refuse, with one sentence naming ``what``, text that is not valid Unicode: bytes that were not UTF-8 arrive from the command
    line or stdin as lone surrogates (Python's surrogateescape), which no tokenizer encodes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        code = ord(text[err.start])
        byte = f"the byte 0x{code - 0xDC00:02x}" if 0xDC80 <= code <= 0xDCFF else f"U+{code:04X}"
        raise LowbitError(
            f"{what} is not valid UTF-8 text ({byte} at character {err.start + 1})"
        ) from None


def encode_prompt(tokenizer, prompt: str | list[dict[str, str]]) -> torch.Tensor:
    """Token ids [1, T] of a plain prompt, or of chat messages through the chat template.

    Args:
        prompt: text (encoded with the tokenizer's special tokens, e.g. BOS), or a list of
            ``{"role": ..., "content": ...}`` messages, rendered by the tokenizer's chat
            template with the assistant's turn opened.
    """
    if isinstance(prompt, str):
        check_text(prompt, "the prompt")
        ids = tokenizer(prompt, return_tensors="pt").input_ids
    else:
        turns: dict[str, int] = {}
        for message in prompt:
            role = str(message.get("role", "message"))
            turns[role] = turns.get(role, 0) + 1
            check_text(str(message.get("content", "")), f"{role} turn {turns[role]} of the chat")
        if not getattr(tokenizer, "chat_template", None):
            raise LowbitError(
                "this model's tokenizer has no chat template, so it cannot hold a chat; "
                "generate from a plain prompt instead"
            )
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.numel() == 0:
        raise LowbitError("the prompt is empty: it encodes to no tokens")
    return ids  # [1, T]


def _peak_memory(device: torch.device) -> tuple[int | None, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device), "peak CUDA memory allocated"
    try:
        import resource
    except ImportError:  # not a Unix
        return None, "not measured on this platform"
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    scale = 1 if sys.platform == "darwin" else 1024  # macOS reports bytes, Linux KiB
    return peak * scale, "process peak RSS since the process started"


def generate(
    model: torch.nn.Module,
    tokenizer,
    prompt: str | list[dict[str, str]],
    *,
    max_new_tokens: int = 128,
    temperature: float = 0.0,
    top_p: float = 1.0,
    streamer: Callable[[str], None] | None = None,
    static_cache: bool = False,
    compile: bool = False,
    prefill_chunk: int = 1024,
) -> GenerationResult:
    """Generate a continuation of ``prompt`` with ``model``, streaming text as it comes.

    Args:
        model: a causal LM, quantized or not; with a quantized KV cache installed
            (``model.lowbit_make_cache``) it generates with that cache.
        tokenizer: the model's tokenizer.
        prompt: text, or chat messages (``[{"role": "user", "content": ...}, ...]``) that the
            tokenizer's chat template renders.
        max_new_tokens: at most this many new tokens (fewer when the model ends its answer).
        temperature: 0 for greedy decoding, else sampling at this temperature (seed torch's
            global generator first for a repeatable sample).
        top_p: nucleus sampling threshold when sampling.
        streamer: called with each piece of finished text (whole words, lines) as it is
            generated; the pieces concatenate to ``result.text``.
        static_cache: decode into a transformers ``StaticCache`` of the prompt's length plus
            ``max_new_tokens`` (fixed shapes; float caches only: a recipe's quantized cache
            grows as it goes).
        compile: run the model's forward through ``torch.compile`` (implies ``static_cache``;
            CUDA graphs on a GPU, Inductor's C++ code on the CPU); the first steps include the
            compile time, so tokens/s of a short answer understates it.
        prefill_chunk: a quantized cache is prefilled this many prompt tokens at a time, each
            chunk written packed before the next, so the prefill's float memory is one chunk's
            (not the float cache of the whole prompt).

    Returns:
        GenerationResult: text, new token ids, prefill and decode times, decode tokens/s,
        peak memory (CUDA: ``max_memory_allocated`` during the call; CPU: the process's
        peak RSS) and the cache used.
    """
    check_sampling(max_new_tokens, temperature, top_p)
    device = next(model.parameters()).device
    ids = encode_prompt(tokenizer, prompt).to(device)  # [1, T]
    context = getattr(model.config, "max_position_embeddings", None)
    if context and ids.shape[1] + max_new_tokens > context:
        raise LowbitError(
            f"the prompt ({ids.shape[1]} tokens) and max_new_tokens ({max_new_tokens}) exceed "
            f"the model's context of {context} tokens"
        )

    if isinstance(prefill_chunk, bool) or not isinstance(prefill_chunk, int) or prefill_chunk < 1:
        raise LowbitError(f"prefill_chunk must be a positive integer, not {prefill_chunk!r}")
    check_cache_fits(model, ids.shape[1] + max_new_tokens, device)

    config = copy.deepcopy(model.generation_config)
    config.max_new_tokens = max_new_tokens
    config.do_sample = temperature > 0
    config.temperature = temperature if temperature > 0 else None
    config.top_p = top_p if temperature > 0 else None
    config.top_k = None
    config.return_dict_in_generate = True
    if config.pad_token_id is None:
        config.pad_token_id = tokenizer.pad_token_id or config.eos_token_id
    make_cache = getattr(model, "lowbit_make_cache", None)
    static_cache = static_cache or compile
    if static_cache and make_cache is not None:
        raise LowbitError(
            "a static cache holds floats, and this model's recipe quantizes its KV cache; "
            "generate without a static cache (or --compile)"
        )
    if static_cache:
        from transformers import StaticCache

        cache = StaticCache(config=model.config, max_cache_len=ids.shape[1] + max_new_tokens)
    else:  # the recipe's quantized cache, or None: transformers' own dynamic cache
        cache = make_cache() if make_cache is not None else None

    timed = TimedStreamer(tokenizer, streamer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    if compile:  # an instance attribute shadows the class's forward until it is deleted
        prepare_layouts(model)  # none made inside a CUDA graph's warm-up
        mode = "reduce-overhead" if device.type == "cuda" else None
        model.forward = torch.compile(model.forward, mode=mode)
    start = time.perf_counter()
    try:
        with torch.no_grad():
            if make_cache is not None and not static_cache:  # all but the last prompt token
                for lo in range(0, ids.shape[1] - 1, prefill_chunk):
                    hi = min(lo + prefill_chunk, ids.shape[1] - 1)
                    model(
                        ids[:, lo:hi],
                        attention_mask=torch.ones_like(ids[:, :hi]),
                        logits_to_keep=1,
                        **{CACHE_KWARG: cache},
                    )
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                **{CACHE_KWARG: cache},
                streamer=timed,
            )
    finally:
        if compile:
            del model.forward
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    new_tokens = out.sequences[0, ids.shape[1] :].tolist()
    times = timed.token_times
    prefill = (times[0] if times else time.perf_counter()) - start
    decode = times[-1] - times[0] if len(times) > 1 else 0.0
    peak, kind = _peak_memory(device)
    return GenerationResult(
        text=tokenizer.decode(new_tokens, skip_special_tokens=True),
        new_tokens=new_tokens,
        prompt_tokens=ids.shape[1],
        prefill_seconds=prefill,
        decode_seconds=decode,
        tokens_per_second=(len(times) - 1) / decode if decode > 0 else None,
        peak_memory_bytes=peak,
        peak_memory_kind=kind,
        cache=_returned_cache(out, cache),
        streamed="".join(timed.pieces),
    )


def kv_cache_bytes(model: torch.nn.Module, tokens: int) -> int:
    """Bytes the model's KV cache takes for ``tokens`` tokens (batch 1): the recipe's analytic
    figure for a quantized cache, else keys and values in the model's dtype."""
    config = model.config
    layers = config.num_hidden_layers
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    layout = getattr(model, "lowbit_kv", None)
    if layout is not None:
        return math.ceil(layout.bytes_per_token(kv_heads, head_dim, tokens) * tokens)
    element = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * element * tokens


def _available_bytes(device: torch.device) -> int:
    from lowbit.io.stream import available_memory

    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    return available_memory()


def check_cache_fits(model: torch.nn.Module, tokens: int, device: torch.device) -> None:
    """Raise LowbitError, before any prefill, if a cache of ``tokens`` tokens would not fit in
    the memory ``device`` has available now."""
    need, free = kv_cache_bytes(model, tokens), _available_bytes(device)
    if need > free:
        raise LowbitError(
            f"the KV cache of {tokens:,} tokens needs {need / 2**30:.2f} GiB ({need:,} bytes), "
            f"more than the {free / 2**30:.2f} GiB available on {device.type}; use a shorter "
            "prompt or fewer new tokens, or a recipe that quantizes the cache"
        )


def _returned_cache(out, given):
    """The cache ``generate`` returned (under this transformers' name for it), else ``given``."""
    returned = getattr(out, CACHE_KWARG, None)
    return returned if returned is not None else given
