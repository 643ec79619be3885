"""lm-evaluation-harness on lowbit models: the model type ``lowbit`` and an offline local task.

lm-eval (0.4) finds model types in its own registry only (no entry points), so
:func:`register` adds ``lowbit`` there; ``lowbit lm-eval`` calls it, then
``lm_eval.simple_evaluate``. The model is lm-eval's ``hf`` model type around a model
:func:`lowbit.api.load_model` loads (a saved lowbit directory: packed weights, activation
quantizers; or a float model), so tokenization and scoring are lm-eval's own. A model with a
quantized KV cache (``lowbit_make_cache``) is scored through that cache, fed ``chunk`` tokens at a
time, so later tokens attend to quantized earlier ones as in ``lowbit eval --chunk``.

:func:`write_cloze_task` writes ``lowbit_pydoc_cloze``: a multiple-choice cloze over CPython's
pydoc evaluation text (each item: a sentence's beginning; the choices: its true last word and
three last words of other sentences), so the bridge runs with no network.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import torch

from lowbit.data import pydoc_text
from lowbit.errors import LowbitError

TASK_NAME = "lowbit_pydoc_cloze"
_REGISTERED = False


def register() -> None:
    """Add the model type ``lowbit`` to lm-eval's registry (once)."""
    global _REGISTERED
    if _REGISTERED:
        return
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM

    class LowbitLM(HFLM):
        """``--model lowbit --model_args path=DIR[,chunk=N]``: lm-eval's ``hf`` scoring on a
        model lowbit loads."""

        def __init__(self, path: str | None = None, chunk: int = 128, **kwargs) -> None:
            from lowbit.api import load_model
            from lowbit.models.run import prepare_run

            loaded = load_model(path)
            prepare_run(loaded.model)
            self.chunk = int(chunk)
            super().__init__(pretrained=loaded.model, tokenizer=loaded.tokenizer, **kwargs)

        def _model_call(self, inps: torch.Tensor, attn_mask=None, labels=None) -> torch.Tensor:
            make_cache = getattr(self.model, "lowbit_make_cache", None)
            if make_cache is None or inps.shape[1] <= self.chunk:
                return super()._model_call(inps, attn_mask, labels)
            with torch.no_grad():  # inps [B, S] -> logits [B, S, V], through the quantized cache
                past, pieces = make_cache(), []
                for start in range(0, inps.shape[1], self.chunk):
                    out = self.model(
                        inps[:, start : start + self.chunk], use_cache=True, past_key_values=past
                    )
                    past = out.past_key_values
                    pieces.append(out.logits)
                return torch.cat(pieces, dim=1)

    register_model("lowbit")(LowbitLM)
    _REGISTERED = True


def cloze_items(n_items: int, seed: int = 0) -> list[dict]:
    """``n_items`` multiple-choice cloze items from the pydoc evaluation text."""
    if isinstance(n_items, bool) or not isinstance(n_items, int) or n_items < 1:
        raise LowbitError(f"the local task needs at least 1 item, not {n_items!r} (--items)")
    sentences = []
    for sentence in re.split(r"(?<=[.!?])\s+", pydoc_text("eval")):
        words = sentence.split()
        if 8 <= len(words) <= 40 and re.fullmatch(r"[a-z]{3,}\.", words[-1]):
            sentences.append((" ".join(words[:-1]), words[-1][:-1]))
    endings = sorted({end for _, end in sentences})
    rng = random.Random(seed)
    items = []
    for context, answer in rng.sample(sentences, min(n_items, len(sentences))):
        choices = rng.sample([e for e in endings if e != answer], 3) + [answer]
        rng.shuffle(choices)
        items.append({"context": context, "choices": choices, "label": choices.index(answer)})
    return items


def write_cloze_task(directory: str | Path, n_items: int = 50, seed: int = 0) -> Path:
    """Write the task's JSONL and YAML into ``directory`` (give it to lm-eval as include_path)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    data = directory / f"{TASK_NAME}.jsonl"
    data.write_text("".join(json.dumps(item) + "\n" for item in cloze_items(n_items, seed)))
    (directory / f"{TASK_NAME}.yaml").write_text(
        f"task: {TASK_NAME}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(data.resolve()))}\n"
        "test_split: test\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{context}}"\n'
        'doc_to_target: "{{label}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'target_delimiter: " "\n'
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
    )
    return directory
