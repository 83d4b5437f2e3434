"""Self-contained HTML reports: headings, tables and matplotlib figures embedded as PNG (no external files)."""

from __future__ import annotations

import base64
import html
import io
from collections.abc import Iterable, Sequence
from typing import Any


class Report:
    def __init__(self, title: str) -> None:
        self.title = title
        self.parts: list[str] = []
        self.figures = 0

    def heading(self, text: str, level: int = 2) -> Report:
        self.parts.append(f"<h{level}>{html.escape(text)}</h{level}>")
        return self

    def text(self, text: str) -> Report:
        self.parts.append(f"<p>{html.escape(text)}</p>")
        return self

    def table(self, header: Sequence[str], rows: Iterable[Sequence[Any]]) -> Report:
        def cell(v: Any) -> str:
            if isinstance(v, float):
                v = f"{v:.4g}"
            return f"<td>{html.escape(str(v))}</td>"

        head = "".join(f"<th>{html.escape(str(h))}</th>" for h in header)
        body = "".join("<tr>" + "".join(cell(v) for v in row) + "</tr>" for row in rows)
        self.parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        return self

    def figure(self, fig, caption: str = "") -> Report:
        """Embed a matplotlib figure as a base64 PNG and close it."""
        import matplotlib.pyplot as plt

        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=90, bbox_inches="tight")
        plt.close(fig)
        data = base64.b64encode(buf.getvalue()).decode()
        self.figures += 1
        cap = f"<figcaption>{html.escape(caption)}</figcaption>" if caption else ""
        self.parts.append(f'<figure><img alt="{html.escape(caption or "figure")}" '
                          f'src="data:image/png;base64,{data}"/>{cap}</figure>')
        return self

    def pre(self, text: str) -> Report:
        self.parts.append(f"<pre>{html.escape(text)}</pre>")
        return self

    def render(self) -> str:
        style = ("body{font-family:sans-serif;max-width:1100px;margin:2em auto;color:#222}"
                 "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}"
                 "th{background:#f3f3f3}figure{margin:1em 0}img{max-width:100%}pre{background:#f7f7f7;padding:8px;"
                 "white-space:pre-wrap;font-size:12px}")
        return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(self.title)}</title>"
                f"<style>{style}</style></head><body><h1>{html.escape(self.title)}</h1>{''.join(self.parts)}</body></html>")


def bar_chart(labels: Sequence[str], series: dict[str, Sequence[float]], ylabel: str, title: str,
              errors: dict[str, Sequence[tuple[float, float]]] | None = None):
    """Grouped bars; `errors` holds (low, high) intervals per bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 3.2))
    x = np.arange(len(labels))
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        yerr = None
        if errors and name in errors:
            lo = [v - e[0] for v, e in zip(values, errors[name], strict=True)]
            hi = [e[1] - v for v, e in zip(values, errors[name], strict=True)]
            yerr = [lo, hi]
        ax.bar(x + i * width - 0.4 + width / 2, values, width, label=name, yerr=yerr, capsize=3)
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return fig


def histogram(values: Sequence[float], xlabel: str, title: str, bins: int = 30):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3))
    ax.hist(values, bins=bins)
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    return fig
