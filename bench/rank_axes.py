"""The axes of the scale plots (``scale.py``, ``scale_compare.py``): ranks on a log2
axis, values on a log axis labelled as plain numbers."""

from __future__ import annotations

from typing import Any

XLABEL = "ranks (one body per rank-step: 8 microbatches × 32 metrics)"


def rank_axes(ax: Any, ranks: list[int], title: str) -> None:
    """Scales, ticks, labels, grid and legend of one scale plot's axes; call it after
    plotting (the y range decides the labels)."""
    import matplotlib.ticker

    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    plain = matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()  # within one decade the minor ticks are the only ones
    ax.yaxis.set_minor_formatter(plain if high < 10 * low else matplotlib.ticker.NullFormatter())
    ax.set_xticks(ranks, [str(int(x)) for x in ranks])
    ax.set_xlabel(XLABEL)
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    # outside the axes, on the right: inside, it hid points (a one-rank plot's column)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
