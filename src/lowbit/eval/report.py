"""``lowbit report``: figures from ``lowbit eval --json`` results in one self-contained HTML page.

The page embeds every figure as a base64 PNG (it opens offline, from any directory); the same
PNGs are written beside it so they can be read or committed alone. The figures of the rows
(ppl and KL against bits per weight, KV cache against context) come from the JSON alone,
nothing re-evaluated; the figures of a model's insides come from measurements the caller made:
per-layer and per-linear error (:mod:`lowbit.eval.layer_error`) and channel magnitudes
(:mod:`lowbit.eval.distributions`).
"""

from __future__ import annotations

import base64
import dataclasses
import html
import io
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path

from lowbit.atomic import atomic_directory
from lowbit.errors import LowbitError
from lowbit.eval.distributions import ChannelMagnitudes
from lowbit.eval.layer_error import LayerError
from lowbit.eval.memory import KV_CONTEXTS
from lowbit.files import read_text

REQUIRED = ("label", "ppl", "kl", "bits_per_weight", "kv_bytes_per_token")


def load_rows(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """The result rows of one or more ``lowbit eval --json`` files (a row or a list of rows)."""
    rows: list[dict] = []
    for path in paths:
        try:
            data = json.loads(read_text(Path(path).expanduser()))
        except json.JSONDecodeError as err:
            raise LowbitError(f"{path} is not JSON ({err})") from err
        found = data if isinstance(data, list) else [data]
        for row in found:
            missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
            if missing:
                raise LowbitError(
                    f"{path} is not a lowbit eval --json result (no {', '.join(missing)})"
                )
            _check_row(row, path)
        rows.extend(found)
    if not rows:
        raise LowbitError("the result files hold no rows")
    return rows


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_row(row: dict, path) -> None:
    """Refuse a row whose fields are not what eval writes: ppl and KL are numbers or null (a NaN
    or an infinity is drawn around, with a note), bits per weight a finite number >= 0."""
    where = f"{path}: the row {str(row['label'])[:40]!r}"
    for key in ("ppl", "kl"):
        if row[key] is not None and not _is_number(row[key]):
            raise LowbitError(f"{where} has {key} {row[key]!r}, not a number")
    bits = row["bits_per_weight"]
    if not _is_number(bits) or not math.isfinite(bits) or bits < 0:
        raise LowbitError(f"{where} has bits_per_weight {bits!r}, not a finite number >= 0")
    if not _is_number(row["kv_bytes_per_token"]):
        raise LowbitError(f"{where} has kv_bytes_per_token {row['kv_bytes_per_token']!r}")


def drawable(value, log_scale: bool = False) -> bool:
    """Whether a figure can place ``value``: a finite number (and > 0 on a log scale)."""
    return _is_number(value) and math.isfinite(value) and (value > 0 or not log_scale)


def _shown(value, spec: str) -> str:
    """A table cell: ``-`` for no value, ``nan``/``inf`` as they are, else formatted."""
    if value is None:
        return "-"
    return format(value, spec) if math.isfinite(value) else str(value)


def is_float(row: dict) -> bool:
    return row.get("recipe", {}).get("method") == "fp" or row["label"] == "fp"


def pareto_front(points: Sequence[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats in both coordinates (lower is better in
    each), sorted by the first coordinate."""
    front = []
    for i, (x, y) in enumerate(points):
        dominated = any(
            (x2 <= x and y2 <= y) and (x2 < x or y2 < y)
            for j, (x2, y2) in enumerate(points)
            if j != i
        )
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # no display: files only
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    _pyplot().close(fig)
    return buffer.getvalue()


def pareto_figure(rows: list[dict], metric: str) -> bytes:
    """``metric`` (ppl or kl) against bits per weight, one point per quantized recipe, the
    Pareto front as a line, float as a horizontal reference line."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    log_scale = metric == "ppl"
    left_out = [r for r in rows if not drawable(r[metric], log_scale)]
    quantized = [r for r in rows if not is_float(r) and r not in left_out]
    points = [(r["bits_per_weight"], r[metric]) for r in quantized]
    for row, (x, y) in zip(quantized, points, strict=True):
        ax.scatter([x], [y], color="tab:blue", zorder=3)
        ax.annotate(row["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = pareto_front(points)
    if front:
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "--",
                color="tab:red", label="Pareto front", zorder=2)  # fmt: skip
    floats = [r for r in rows if is_float(r) and r not in left_out]
    for row in floats:
        ax.axhline(row[metric], color="gray", linewidth=1, label=f"float ({row['label']})")
    if log_scale and (points or floats):
        ax.set_yscale("log")
    if left_out:  # said on the figure, so an empty or partial plot is never silent
        shown = ", ".join(f"{r['label']} ({_shown(r[metric], '.4g')})" for r in left_out)
        ax.text(0.01, 0.99, f"not drawn, {metric} not a finite number: {shown}",
                transform=ax.transAxes, fontsize=7, va="top", wrap=True)  # fmt: skip
    ax.set_xlabel("bits per weight")
    ax.set_ylabel({"ppl": "perplexity", "kl": "KL(float || quantized), nats/token"}[metric])
    ax.set_title(f"{metric} against bits per weight")
    ax.grid(alpha=0.3)
    if points or floats:
        ax.legend(fontsize=8)
    return _png(fig)


def _kv_curve(row: dict) -> tuple[float, ...]:
    """Bytes per token at each of :data:`KV_CONTEXTS`: as the eval stated them at each context,
    or (older rows) the one figure it stated, at every context."""
    by_context = row.get("kv_bytes_by_context") or {}
    return tuple(float(by_context.get(str(c), row["kv_bytes_per_token"])) for c in KV_CONTEXTS)


def kv_figure(rows: list[dict]) -> bytes:
    """KV-cache bytes per token and in total against context length, one line per distinct KV
    cache among the rows."""
    plt = _pyplot()
    fig, (per_token, total) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    seen: dict[tuple[float, ...], str] = {}
    left_out = []
    for row in rows:
        curve = _kv_curve(row)
        if all(drawable(v) for v in curve):
            seen.setdefault(curve, row["label"])
        else:
            left_out.append(row["label"])
    if left_out:
        fig.text(0.01, 0.01, f"not drawn, KV bytes not a finite number: {', '.join(left_out)}",
                 fontsize=7)  # fmt: skip
    for curve, label in sorted(seen.items(), reverse=True):
        per_token.plot(KV_CONTEXTS, curve, marker="o", label=label)
        totals = [per * c / 2**20 for per, c in zip(curve, KV_CONTEXTS, strict=True)]
        total.plot(KV_CONTEXTS, totals, marker="o", label=label)
    for ax in (per_token, total):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length, tokens")
        ax.grid(alpha=0.3)
    per_token.set_ylabel("KV bytes per token")
    total.set_ylabel("KV cache, MiB")
    total.set_yscale("log")
    if seen:
        per_token.legend(fontsize=7)
    fig.suptitle("KV cache against context length")
    return _png(fig)


def layer_error_figure(errors: Sequence[LayerError]) -> bytes:
    """The residual stream's relative squared error after each block, one line per recipe."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for error in errors:
        ax.plot(range(len(error.blocks)), error.blocks, marker=".", label=error.label)
    ax.set_yscale("log")
    ax.set_xlabel("block")
    ax.set_ylabel("‖y − y_float‖² / ‖y_float‖², residual stream")
    ax.set_title("error after each block against float")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def linear_error_figure(errors: Sequence[LayerError]) -> bytes:
    """Each linear's relative squared output error by block, one heat map per recipe on one
    shared log colour scale."""
    import numpy as np

    plt = _pyplot()
    tables = [np.array(list(e.linears.values())) for e in errors]  # each [7 linears, L]
    finite = np.concatenate([t[np.isfinite(t) & (t > 0)] for t in tables] + [np.ones(1)])
    low, high = np.log10(finite.min()), np.log10(finite.max())
    fig, axes = plt.subplots(
        len(errors), 1, figsize=(9.6, 1.9 * len(errors) + 0.6), squeeze=False, sharex=True
    )
    for ax, error, table in zip(axes[:, 0], errors, tables, strict=True):
        image = ax.imshow(
            np.log10(np.maximum(table, 10.0**low)), aspect="auto", vmin=low, vmax=high,
            cmap="viridis", interpolation="nearest",
        )  # fmt: skip
        ax.set_yticks(range(len(error.linears)), list(error.linears), fontsize=7)
        ax.set_title(error.label, fontsize=9)
    axes[-1, 0].set_xlabel("block")
    fig.colorbar(image, ax=axes[:, 0], label="log10 relative squared error")
    return _png(fig)


def channels_figure(m: ChannelMagnitudes) -> bytes:
    """Largest |x| per channel at q_proj's input before and after the rotation, and of the
    pre-RoPE keys in model order and in K-sort order (head boundaries dotted)."""
    plt = _pyplot()
    fig, ((act, act_rot), (key, key_sorted)) = plt.subplots(2, 2, figsize=(11, 6.4))
    top = float(max(m.activations.max(), m.activations_rotated.max()))
    for ax, values, title in (
        (act, m.activations, "q_proj input, float model"),
        (act_rot, m.activations_rotated, "q_proj input, after the rotation"),
    ):
        ax.bar(range(values.numel()), values.cpu().numpy(), width=1.0)
        ax.set_ylim(0, top * 1.05)
        ax.set_title(f"block {m.layer}: {title}", fontsize=9)
        ax.set_xlabel("channel")
    top = float(m.keys.max())
    for ax, values, title in (
        (key, m.keys, "pre-RoPE keys, model order"),
        (key_sorted, m.keys_sorted, "pre-RoPE keys, K-sort order"),
    ):
        ax.bar(range(values.numel()), values.cpu().numpy(), width=1.0, color="tab:orange")
        for boundary in range(m.head_dim, values.numel(), m.head_dim):
            ax.axvline(boundary - 0.5, color="gray", linestyle=":", linewidth=1)
        ax.set_ylim(0, top * 1.05)
        ax.set_title(f"block {m.layer}: {title}", fontsize=9)
        ax.set_xlabel(f"channel (heads of {m.head_dim})")
    act.set_ylabel("max |x| over tokens")
    key.set_ylabel("max |k| over tokens")
    fig.tight_layout()
    return _png(fig)


def build_figures(
    rows: list[dict],
    layer_errors: Sequence[LayerError] = (),
    magnitudes: ChannelMagnitudes | None = None,
) -> dict[str, bytes]:
    """File name -> PNG bytes of every figure the rows and measurements give."""
    figures = {}
    if rows:
        figures["pareto-ppl.png"] = pareto_figure(rows, "ppl")
        figures["pareto-kl.png"] = pareto_figure(rows, "kl")
        figures["kv-cache.png"] = kv_figure(rows)
    if layer_errors:
        figures["layer-error.png"] = layer_error_figure(layer_errors)
        figures["linear-error.png"] = linear_error_figure(layer_errors)
    if magnitudes is not None:
        figures["channels.png"] = channels_figure(magnitudes)
    return figures


def build_html(rows: list[dict], figures: dict[str, bytes], model: str = "") -> str:
    """One page: a table of the rows and every figure as an embedded PNG."""
    cells = "".join(
        f"<tr><td>{html.escape(str(r['label']))}</td><td>{r['bits_per_weight']:.3f}</td>"
        f"<td>{_shown(r['ppl'], '.3f')}</td><td>{_shown(r['kl'], '.4f')}</td>"
        f"<td>{_shown(r['kv_bytes_per_token'], '.0f')}</td></tr>"
        for r in rows
    )
    images = "".join(
        f'<figure><img id="{html.escape(name)}" alt="{html.escape(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, png in figures.items()
    )
    table = (
        "<table><tr><th>recipe</th><th>bits/weight</th><th>ppl</th><th>KL</th>"
        f"<th>KV bytes/token</th></tr>{cells}</table>"
        if rows
        else ""
    )
    model = html.escape(str(rows[0].get("model", "")) if rows else model)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>lowbit report</title>"
        "<style>body{font-family:sans-serif;margin:1em}td,th{padding:2px 8px}"
        "figure{display:inline-block;margin:4px}</style></head><body>"
        f"<h1>lowbit report: {model}</h1>{table}{images}"
        "</body></html>\n"
    )


def measurements_dict(
    layer_errors: Sequence[LayerError], magnitudes: ChannelMagnitudes | None
) -> dict:
    """The measurements as JSON-ready lists (what the insides' figures plot)."""
    found: dict = {"layer_error": [dataclasses.asdict(e) for e in layer_errors]}
    if magnitudes is not None:
        found["channels"] = {
            k: v.tolist() if hasattr(v, "tolist") else v
            for k, v in dataclasses.asdict(magnitudes).items()
        }
    return found


def write_report(
    paths: Sequence[str | os.PathLike],
    out: str | os.PathLike,
    *,
    layer_errors: Sequence[LayerError] = (),
    magnitudes: ChannelMagnitudes | None = None,
    model: str = "",
    force: bool = False,
) -> Path:
    """Write ``out`` (a new or empty directory; with ``force`` a regular file there is
    replaced), whole or not at all: ``index.html``, every
    figure as a PNG file, and the measurements given as ``measurements.json`` (the numbers
    behind their figures), from the eval results in ``paths``. Returns the page's path."""
    rows = load_rows(paths) if paths else []
    if not rows and not layer_errors and magnitudes is None:
        raise LowbitError("nothing to report: give eval --json files, --layer-error or --channels")
    figures = build_figures(rows, layer_errors, magnitudes)
    page = build_html(rows, figures, model)
    with atomic_directory(out, verb="write the report to", force=force) as tmp:
        for name, png in figures.items():
            (tmp / name).write_bytes(png)
        (tmp / "index.html").write_text(page)
        if layer_errors or magnitudes is not None:
            (tmp / "measurements.json").write_text(
                json.dumps(measurements_dict(layer_errors, magnitudes), indent=1) + "\n"
            )
    return Path(out).expanduser() / "index.html"
