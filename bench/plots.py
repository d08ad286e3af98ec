"""PNG plots of one run or several on the same axes: TTFT and ITL CDFs, throughput over time, and where the
prompt tokens came from (local prefix cache, KV store, computed: over time for one run, as shares side by
side for several).

Headless (matplotlib's Agg backend) and fixed pixel sizes (no tight bounding box), so a file's
size says what it is: single plots PLOT_SIZE, the overview (four plots and the table beside
them) OVERVIEW_SIZE.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.axes import Axes  # noqa: E402

from pdserve.bench import report, stats  # noqa: E402

DPI = 100
PLOT_SIZE = (800, 500)  # pixels
OVERVIEW_SIZE = (1600, 900)
PLOTS = ("ttft_cdf", "itl_cdf", "throughput", "prompt_sources")
_TIER_COLOURS = {stats.LOCAL: "#3b6fd6", stats.STORE: "#1e8e3e", stats.COMPUTED: "#d98c1f",
                 stats.CACHED_USAGE: "#7a9bd9", stats.COMPUTED_USAGE: "#e0b36a"}


def _cdf(ax: Axes, results: list[dict[str, Any]], key: str, title: str) -> None:
    lows, highs = [], []
    for r in results:
        done = [q for q in r["requests"] if q["ok"]]
        values = np.sort(np.array([g for q in done for g in q["itl"]] if key == "itl" else [q[key] for q in done])
                         * 1e3)
        if values.size:
            ax.plot(values, np.arange(1, values.size + 1) / values.size, label=r["label"], drawstyle="steps-post")
            lows.append(max(values[0], 1e-3))
            highs.append(values[-1])
    if lows and max(highs) / min(lows) > 50:
        ax.set_xscale("log")
    ax.set_xlabel(f"{title} (ms)")
    ax.set_ylabel("fraction of " + ("gaps" if key == "itl" else "requests"))
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title} CDF")


def _throughput(ax: Axes, results: list[dict[str, Any]]) -> None:
    for r in results:
        t, rate = stats.throughput_series(r["requests"])
        ax.plot(t, rate, label=r["label"])
    ax.set_xlabel("time since start (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_ylim(bottom=0)
    ax.set_title("Output throughput over time")


def _prompt_sources(ax: Axes, results: list[dict[str, Any]]) -> None:
    """One run: prompt tokens/s by tier over time, stacked. Several: each run's shares, one bar each."""
    if len(results) == 1:
        got = stats.prompt_source_series(results[0])
        if got is None:
            ax.text(0.5, 0.5, "no cache figures (no /metrics, no cached_tokens)", ha="center", transform=ax.transAxes)
        else:
            edges, series = got
            bottom = np.zeros(len(edges) - 1)
            for tier, rate in series.items():  # one bar per sampling interval, the tiers stacked
                ax.bar(edges[:-1], rate, width=np.diff(edges), bottom=bottom, align="edge",
                       color=_TIER_COLOURS[tier], label=tier)
                bottom += rate
            ax.set_ylim(0, max(1.0, float(bottom.max())) * 1.3)  # headroom for the legend
            ax.legend(fontsize="small", loc="upper center", ncol=3)
            ax.set_xlabel("time since start (s)")
            ax.set_ylabel("prompt tokens/s")
        ax.set_title("Prompt tokens by source over time" + _sources_note(results))
        return
    labels = [r["label"] for r in results]
    y = np.arange(len(results))[::-1]
    left = np.zeros(len(results))
    for tier in _TIER_COLOURS:
        shares = []
        for r in results:
            got = stats.prompt_sources(r) or {}
            total = sum(got.values())
            shares.append(100 * got.get(tier, 0.0) / total if total else 0.0)
        if any(shares):
            ax.barh(y, shares, left=left, color=_TIER_COLOURS[tier], label=tier)
            left += np.array(shares)
    ax.set_yticks(y, labels)
    ax.set_ylim(-0.6, len(results) + 0.6)  # the top row holds the legend
    ax.legend(fontsize="small", loc="upper center", ncol=3)
    ax.set_xlim(0, 100)
    ax.set_xlabel("share of prompt tokens (%)")
    ax.set_title("Prompt tokens by source" + _sources_note(results))


def _sources_note(results: list[dict[str, Any]]) -> str:
    if any((r.get("metrics") or {}).get("delta") for r in results):
        return "\n(summed over nodes: on P/D prefill and decode each serve the prompt)"
    return ""


def _draw(name: str, ax: Axes, results: list[dict[str, Any]]) -> None:
    {"ttft_cdf": lambda: _cdf(ax, results, "ttft", "TTFT"), "itl_cdf": lambda: _cdf(ax, results, "itl", "ITL"),
     "throughput": lambda: _throughput(ax, results),
     "prompt_sources": lambda: _prompt_sources(ax, results)}[name]()
    ax.grid(True, alpha=0.3)
    if ax.get_legend() is None and ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize="small")


def _figure(size: tuple[int, int]):
    return plt.figure(figsize=(size[0] / DPI, size[1] / DPI), dpi=DPI)


def write_plots(results: list[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """The four single plots and the overview; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = []
    for name in PLOTS:
        fig = _figure(PLOT_SIZE)
        _draw(name, fig.add_subplot(1, 1, 1), results)
        fig.tight_layout()
        paths.append(out_dir / f"{prefix}{name}.png")
        fig.savefig(paths[-1], dpi=DPI)
        plt.close(fig)
    paths.append(write_overview(results, out_dir / f"{prefix}overview.png"))
    return paths


def write_overview(results: list[dict[str, Any]], path: Path) -> Path:
    """Four plots in a 2x2 grid with the summary table beside them."""
    fig = _figure(OVERVIEW_SIZE)
    captions = report.captions(results)
    top = max(0.7, 0.9 - 0.022 * (len(captions) - 1))  # room for one caption line per workload
    grid = fig.add_gridspec(2, 3, width_ratios=[1, 1, 1.15], left=0.05, right=0.99, top=top, bottom=0.07,
                            wspace=0.28, hspace=0.35)
    for i, name in enumerate(PLOTS):
        _draw(name, fig.add_subplot(grid[i // 2, i % 2]), results)
    ax = fig.add_subplot(grid[:, 2])
    ax.axis("off")
    header, body = report.rows(results, compact=True)
    chars = [max(len(row[i]) for row in [header, *body]) * (1.15 if i == 0 else 1.0) + 2 for i in range(len(header))]
    widths = [c / sum(chars) for c in chars]
    height = min(0.95, 0.045 * (len(body) + 1))
    table = ax.table(cellText=body, colLabels=header, colWidths=widths, cellLoc="right", colLoc="right",
                     bbox=[0.0, 0.5 - height / 2, 1.0, height])
    table.auto_set_font_size(False)
    table.set_fontsize(8 if len(header) <= 4 else 7)
    caption = report.slo_caption(results)
    if caption:
        ax.text(0.0, 0.5 - height / 2 - 0.02, f"goodput SLO: {caption}", fontsize=8, va="top", wrap=True)
    fig.suptitle("\n".join(captions), fontsize=10 if len(captions) == 1 else 8)
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path
