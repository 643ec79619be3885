"""``lowbit report``: figures from ``lowbit eval --json`` results in one self-contained HTML page.

The page embeds every figure as a base64 PNG (it opens offline, from any directory); the same
PNGs are written beside it so they can be read or committed alone. Nothing is re-evaluated: the
figures come from the JSON rows alone.
"""

from __future__ import annotations

import base64
import html
import io
import json
import os
from collections.abc import Sequence
from pathlib import Path

from lowbit.atomic import atomic_directory
from lowbit.errors import LowbitError

# context lengths the KV-cache figure plots, tokens
KV_CONTEXTS = [512, 1024, 2048, 4096, 8192, 16384, 32768]
REQUIRED = ("label", "ppl", "kl", "bits_per_weight", "kv_bytes_per_token")


def load_rows(paths: Sequence[str | os.PathLike]) -> list[dict]:
    """The result rows of one or more ``lowbit eval --json`` files (a row or a list of rows)."""
    rows: list[dict] = []
    for path in paths:
        try:
            data = json.loads(Path(path).expanduser().read_text())
        except OSError as err:
            raise LowbitError(f"cannot read {path}: {err.strerror}") from err
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise LowbitError(f"{path} is not JSON ({err})") from err
        found = data if isinstance(data, list) else [data]
        for row in found:
            missing = [k for k in REQUIRED if not isinstance(row, dict) or k not in row]
            if missing:
                raise LowbitError(
                    f"{path} is not a lowbit eval --json result (no {', '.join(missing)})"
                )
        rows.extend(found)
    if not rows:
        raise LowbitError("the result files hold no rows")
    return rows


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
    quantized = [r for r in rows if not is_float(r)]
    points = [(r["bits_per_weight"], r[metric]) for r in quantized]
    for row, (x, y) in zip(quantized, points, strict=True):
        ax.scatter([x], [y], color="tab:blue", zorder=3)
        ax.annotate(row["label"], (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    front = pareto_front(points)
    if front:
        ax.plot([points[i][0] for i in front], [points[i][1] for i in front], "--",
                color="tab:red", label="Pareto front", zorder=2)  # fmt: skip
    for row in (r for r in rows if is_float(r)):
        ax.axhline(row[metric], color="gray", linewidth=1, label=f"float ({row['label']})")
    if metric == "ppl" and points:
        ax.set_yscale("log")
    ax.set_xlabel("bits per weight")
    ax.set_ylabel({"ppl": "perplexity", "kl": "KL(float || quantized), nats/token"}[metric])
    ax.set_title(f"{metric} against bits per weight")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _png(fig)


def kv_figure(rows: list[dict]) -> bytes:
    """KV-cache bytes per token and in total against context length, one line per distinct KV
    cache among the rows (its bytes per token as the eval measured them)."""
    plt = _pyplot()
    fig, (per_token, total) = plt.subplots(1, 2, figsize=(9.6, 4.0))
    seen: dict[float, str] = {}
    for row in rows:
        seen.setdefault(row["kv_bytes_per_token"], row["label"])
    for per, label in sorted(seen.items(), reverse=True):
        per_token.plot(KV_CONTEXTS, [per] * len(KV_CONTEXTS), marker="o", label=label)
        total.plot(KV_CONTEXTS, [per * c / 2**20 for c in KV_CONTEXTS], marker="o", label=label)
    for ax in (per_token, total):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length, tokens")
        ax.grid(alpha=0.3)
    per_token.set_ylabel("KV bytes per token")
    total.set_ylabel("KV cache, MiB")
    total.set_yscale("log")
    per_token.legend(fontsize=7)
    fig.suptitle("KV cache against context length")
    return _png(fig)


def build_figures(rows: list[dict]) -> dict[str, bytes]:
    """File name -> PNG bytes of every figure the rows give."""
    return {
        "pareto-ppl.png": pareto_figure(rows, "ppl"),
        "pareto-kl.png": pareto_figure(rows, "kl"),
        "kv-cache.png": kv_figure(rows),
    }


def build_html(rows: list[dict], figures: dict[str, bytes]) -> str:
    """One page: a table of the rows and every figure as an embedded PNG."""
    cells = "".join(
        f"<tr><td>{html.escape(str(r['label']))}</td><td>{r['bits_per_weight']:.3f}</td>"
        f"<td>{r['ppl']:.3f}</td><td>{r['kl']:.4f}</td><td>{r['kv_bytes_per_token']:.0f}</td></tr>"
        for r in rows
    )
    images = "".join(
        f'<figure><img id="{html.escape(name)}" alt="{html.escape(name)}" '
        f'src="data:image/png;base64,{base64.b64encode(png).decode()}">'
        f"<figcaption>{html.escape(name)}</figcaption></figure>"
        for name, png in figures.items()
    )
    model = html.escape(str(rows[0].get("model", "")))
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>lowbit report</title>"
        "<style>body{font-family:sans-serif;margin:1em}td,th{padding:2px 8px}"
        "figure{display:inline-block;margin:4px}</style></head><body>"
        f"<h1>lowbit report: {model}</h1><table><tr><th>recipe</th><th>bits/weight</th>"
        f"<th>ppl</th><th>KL</th><th>KV bytes/token</th></tr>{cells}</table>{images}"
        "</body></html>\n"
    )


def write_report(paths: Sequence[str | os.PathLike], out: str | os.PathLike) -> Path:
    """Write ``out`` (a new or empty directory), whole or not at all: ``index.html`` and every
    figure as a PNG file. Returns the page's path."""
    rows = load_rows(paths)
    figures = build_figures(rows)
    page = build_html(rows, figures)
    with atomic_directory(out, verb="write the report to") as tmp:
        for name, png in figures.items():
            (tmp / name).write_bytes(png)
        (tmp / "index.html").write_text(page)
    return Path(out).expanduser() / "index.html"
