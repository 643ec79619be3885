"""lowbit's GGUF files against llama.cpp's own quantizer, every file measured by llama.cpp.

One run, the embedded SmolLM2-135M-Instruct, per block type side by side:

* ``float``: the float model written as an F32 GGUF (what llama.cpp's quantizer reads);
* ``llama.cpp``: its C API ``llama_model_quantize`` on that file at the file type
  (``LLAMA_FTYPE_MOSTLY_<TYPE>``: its mix of tensor types), without and with an importance
  matrix. The matrix is the mean of ``x²`` per input channel of every block linear over the
  calibration windows (what ``llama-imatrix`` accumulates and ``llama-quantize`` hands over),
  taken with forward hooks on the float model in transformers and handed to the C API in
  memory (``llama_model_imatrix_data``: the form 0.3.36's ``llama_model_quantize`` reads);
* ``lowbit RTN``, ``lowbit GPTQ``, ``lowbit rotate+GPTQ``: the ``gguf`` recipe at the same file
  type, every tensor on the type llama.cpp's rules give it without an importance matrix
  (:mod:`lowbit.formats.gguf_mix`; ``rotate`` with ``online=false``), exported by
  ``lowbit.io.gguf``.

Columns: file MB, bits per weight of the block linears, perplexity, KL to the float model in
transformers and top-1 agreement per corpus (WikiText-2 test and pydoc; llama.cpp's logits on
lowbit's windows, :mod:`lowbit.eval.llama_cpp`), llama.cpp's decode tokens/s (batch 1, greedy).
A second table gives lowbit's KL as a ratio of llama.cpp's at the same type, and lowbit's Q4_0
against llama.cpp's Q5_0 where both ran. Calibration (GPTQ and the importance matrix alike):
``--calib-samples`` windows of ``--calib-seqlen`` tokens, seed 0, from ``--calib-dataset``:
pydoc's calibration text, WikiText-2 after the evaluated windows, or half of each (``both``).

Commands (accuracy by type, then the decode speed of every file left in --work-dir)::

    python benchmarks/bench_gguf.py --types Q4_0 IQ4_NL Q4_K_M --new-tokens 0 --out docs/results/gguf.md
    python benchmarks/bench_gguf.py --speed-only --out docs/results/gguf.md
"""

from __future__ import annotations

import argparse
import copy
import ctypes
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import WIKITEXT, command_line, fmt, markdown_table, stamp  # noqa: E402

TYPES = ("Q8_0", "Q5_0", "Q4_0", "Q4_1", "IQ4_NL", "Q4_K_M", "Q3_K_M", "Q2_K")
ROWS = ("llama.cpp", "llama.cpp imatrix", "lowbit RTN", "lowbit GPTQ", "lowbit rotate+GPTQ")


def importance_matrix(model, calibration) -> dict:
    """``{gguf tensor name: [in] mean x²}`` over every calibration token, per block linear."""
    import torch

    from lowbit.models.adapter import adapter_for
    from lowbit.recipes.gguf import GGUF_LINEAR_NAMES as names

    sums, hooks = {}, []
    for block in adapter_for(model).blocks():
        for short, linear in block.linears().items():
            key = f"blk.{block.index}.{names[short]}.weight"

            def hook(module, inputs, output, key=key):
                x = inputs[0].detach().float().reshape(-1, inputs[0].shape[-1])  # [T, in]
                total, count = sums.get(key, (0.0, 0))
                sums[key] = (total + x.square().sum(0), count + x.shape[0])

            hooks.append(linear.register_forward_hook(hook))
    with torch.no_grad():
        for window in calibration:
            model(window[None], use_cache=False)
    for h in hooks:
        h.remove()
    return {key: total / count for key, (total, count) in sums.items()}


def calibration_windows(args, tokenizer):
    """``--calib-samples`` windows [N, calib_seqlen] from ``--calib-dataset``; WikiText-2's are
    drawn after the windows this run evaluates."""
    import math

    import torch

    from lowbit.data import calibration_samples, load_corpus, tokenize

    wiki_count = {"pydoc": 0, "wikitext2": args.calib_samples, "both": args.calib_samples // 2}
    wiki_count = wiki_count[args.calib_dataset]
    parts = []
    if wiki_count:
        wiki = tokenize(tokenizer, load_corpus(str(WIKITEXT)).text)
        skip = math.ceil(args.windows * args.seqlen / args.calib_seqlen)
        parts.append(calibration_samples(wiki, wiki_count, args.calib_seqlen, seed=0,
                                         skip_windows=skip))  # fmt: skip
    if wiki_count < args.calib_samples:
        pydoc = tokenize(tokenizer, load_corpus("pydoc", part="calibration").text)
        parts.append(calibration_samples(pydoc, args.calib_samples - wiki_count,
                                         args.calib_seqlen, seed=0))  # fmt: skip
    return torch.cat(parts)


def llama_cpp_quantize(source: Path, out: Path, type_name: str, imatrix=None) -> None:
    """llama.cpp's own quantizer (C API) at the type's named mix."""
    import llama_cpp

    from lowbit.formats.gguf_mix import FILE_TYPES

    params = llama_cpp.llama_model_quantize_default_params()
    params.nthread = 2
    params.ftype = FILE_TYPES[type_name][0]
    keep = []
    if imatrix is not None:
        entries = (llama_cpp.llama_model_imatrix_data * (len(imatrix) + 1))()
        for i, (name, values) in enumerate(imatrix.items()):
            data = values.numpy().astype("float32")
            keep.append(data)
            entries[i].name = name.encode()
            entries[i].data = data.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
            entries[i].size = data.size
        entries[len(imatrix)].name = None
        params.imatrix = ctypes.cast(entries, ctypes.POINTER(llama_cpp.llama_model_imatrix_data))
    status = llama_cpp.llama_model_quantize(
        str(source).encode(), str(out).encode(), ctypes.byref(params)
    )
    if status != 0:
        raise RuntimeError(f"llama_model_quantize failed ({status}) for {type_name}")


def ratio_table(table: list[list[str]]) -> str:
    """lowbit's KL as a ratio of llama.cpp's own file's (without, with imatrix) per corpus."""
    kl = {(r[0], r[1]): (float(r[5]), float(r[8])) for r in table}
    rows = []
    for (type_name, label), (wiki, pydoc) in kl.items():
        if not label.startswith("lowbit"):
            continue
        cells = [type_name, label]
        for base in ("llama.cpp", "llama.cpp imatrix"):
            ref = kl.get((type_name, base))
            cells += [fmt(None if ref is None else wiki / ref[0], ".3f"),
                      fmt(None if ref is None else pydoc / ref[1], ".3f")]  # fmt: skip
        rows.append(cells)
    header = ["type", "file", "wiki KL / llama.cpp", "pydoc KL / llama.cpp",
              "wiki KL / llama.cpp imatrix", "pydoc KL / llama.cpp imatrix"]  # fmt: skip
    return markdown_table(header, rows)


def q4_0_against_q5_0(table: list[list[str]]) -> str:
    """lowbit's Q4_0 files (4.5 bits) against llama.cpp's own Q5_0 (5.5 bits): KL ratios."""
    kl = {(r[0], r[1]): (float(r[5]), float(r[8])) for r in table}
    ref = kl.get(("Q5_0", "llama.cpp"))
    rows = [
        ["Q4_0", label, f"{wiki / ref[0]:.3f}", f"{pydoc / ref[1]:.3f}"]
        for (type_name, label), (wiki, pydoc) in kl.items()
        if ref and type_name == "Q4_0" and label.startswith("lowbit")
    ]
    header = ["type", "file", "wiki KL / llama.cpp Q5_0", "pydoc KL / llama.cpp Q5_0"]
    return markdown_table(header, rows) if rows else ""


def _file(work: Path, row: str, type_name: str) -> Path:
    return work / f"{row.replace(' ', '-').replace('+', '_')}-{type_name}.gguf"


def speed_table(args) -> None:
    """Decode tokens/s of the files in --work-dir, each in turn, several rounds interleaved."""
    from lowbit.eval.llama_cpp import decode_speed

    work = Path(args.work_dir)
    files = [("—", "float (F32)", work / "float-F32.gguf")]
    files += [(t, row, _file(work, row, t)) for t in args.types for row in args.rows]
    files = [f for f in files if f[2].is_file()]
    print(f"timing {len(files)} files", flush=True)
    best = {path: 0.0 for _, _, path in files}
    for _ in range(3):  # best of 3 rounds, interleaved, so a burst of load hits every file alike
        for _, _, path in files:
            best[path] = max(best[path], decode_speed(path, args.threads, args.new_tokens))
    own = {t: best[path] for t, row, path in files if row == "llama.cpp"}
    rows = [
        [t, row, f"{best[path]:.1f}", fmt(best[path] / own[t] if t in own else None, ".3f")]
        for t, row, path in files
    ]
    header = ["type", "file", "decode tok/s", "x llama.cpp's file"]
    text = "\n\n".join([stamp(command_line()), markdown_table(header, rows)])
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=list(TYPES))
    parser.add_argument("--rows", nargs="+", default=list(ROWS), choices=list(ROWS))
    parser.add_argument("--windows", type=int, default=8, help="windows per corpus")
    parser.add_argument("--seqlen", type=int, default=512)
    parser.add_argument("--calib-samples", type=int, default=16)
    parser.add_argument("--calib-seqlen", type=int, default=512)
    parser.add_argument(
        "--calib-dataset",
        choices=("pydoc", "wikitext2", "both"),
        default="both",
        help="calibration text: pydoc's calibration part, WikiText-2 after the evaluated "
        "windows, or half of each",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--work-dir", default="/tmp/lowbit-bench-gguf")
    parser.add_argument("--out", default=None, help="append the table to this markdown file")
    parser.add_argument(
        "--speed-only",
        action="store_true",
        help="only time decoding of the files an earlier run left in --work-dir (run it on a "
        "quiet machine: decode speed suffers from shared cores more than accuracy does)",
    )
    args = parser.parse_args()
    if args.speed_only:
        speed_table(args)
        return

    import torch

    import lowbit
    from lowbit.eval.evaluate import FloatReference
    from lowbit.eval.llama_cpp import decode_speed, evaluate_gguf
    from lowbit.io.gguf import export_gguf
    from lowbit.models.loader import embedded_gguf_path, load_model
    from lowbit.recipes.registry import get_recipe

    torch.set_num_threads(args.threads)
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    loaded = load_model(None)
    base, tokenizer, source = loaded.model, loaded.tokenizer, embedded_gguf_path()
    calibration = calibration_windows(args, tokenizer)
    references = {}
    for dataset in (str(WIKITEXT), "pydoc"):
        ref = FloatReference(base)
        ref.tokenizer = tokenizer
        references[dataset] = ref

    def measure(label: str, type_name: str, path: Path, seconds: float | None) -> list[str]:
        cells = [type_name, label]
        results = [
            evaluate_gguf(path, dataset=d, seqlen=args.seqlen, windows=args.windows,
                          threads=args.threads, progress=False, float_reference=r)
            for d, r in references.items()
        ]  # fmt: skip
        speed = None  # --new-tokens 0: accuracy only (time decoding apart, --speed-only)
        if args.new_tokens:
            speed = decode_speed(path, threads=args.threads, new_tokens=args.new_tokens)
        cells += [f"{results[0]['model_bytes'] / 1e6:.1f}", f"{results[0]['bits_per_weight']:.3f}"]
        for r in results:
            cells += [f"{r['ppl']:.3f}", f"{r['kl']:.4f}", f"{r['top1']:.4f}"]
        cells += [fmt(speed, ".1f"), fmt(seconds, ".0f")]
        print(" | ".join(cells), flush=True)
        return cells

    table = []
    float_path = work / "float-F32.gguf"
    export_gguf(base, float_path, source_gguf=source, name="SmolLM2-135M-Instruct float")
    table.append(measure("float (F32)", "—", float_path, None))
    imatrix = None
    if "llama.cpp imatrix" in args.rows:
        imatrix = importance_matrix(base, calibration)
    for type_name in args.types:
        for row in args.rows:
            path = _file(work, row, type_name)
            start = time.perf_counter()
            if row.startswith("llama.cpp"):
                llama_cpp_quantize(
                    float_path, path, type_name, imatrix if "imatrix" in row else None
                )
            else:
                model = copy.deepcopy(base)
                algo = "rtn" if row == "lowbit RTN" else "gptq"
                if row == "lowbit rotate+GPTQ":
                    recipe = get_recipe("rotate+gguf", online=False, gguf_type=type_name)
                else:
                    recipe = get_recipe("gguf", gguf_type=type_name, w_algo=algo)
                lowbit.quantize(model, recipe, calibration=calibration, progress=False)
                export_gguf(model, path, source_gguf=source, name=f"SmolLM2 lowbit {row}")
                del model
            table.append(measure(row, type_name, path, time.perf_counter() - start))

    header = ["type", "file", "file MB", "bits/w", "wiki ppl", "wiki KL", "wiki top-1",
              "pydoc ppl", "pydoc KL", "pydoc top-1", "decode tok/s", "quantize s"]  # fmt: skip
    tables = [markdown_table(header, table), ratio_table(table), q4_0_against_q5_0(table)]
    text = "\n\n".join([stamp(command_line())] + [t for t in tables if t])
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + text + "\n")


if __name__ == "__main__":
    main()
