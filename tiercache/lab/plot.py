"""Hit ratio against device budget, one line per policy, Belady on top.

matplotlib is imported only inside :func:`plot_hit_ratio`
(``pip install 'tiercache[lab]'``); the figure is drawn with the Agg canvas
directly, so pyplot's global backend is never touched.
"""

from __future__ import annotations

import os
from pathlib import Path

_MIB = 1 << 20
_BELADY_LABEL = "Belady (optimal)"


def plot_hit_ratio(results: list[dict], path: str | os.PathLike, title: str = "") -> Path:
    """Write a PNG of hit ratio vs budget.

    Args:
        results: dicts with ``policy``, ``budget_bytes`` and ``hit_ratio``;
            optional ``prefetch`` (appended to the label unless ``"none"``) and
            ``trace`` (one subplot per distinct trace when there are several).
        path: where the PNG goes.
        title: figure title.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> plot_hit_ratio(replay_libcachesim("t.csv", ["lru", "belady"], budgets), "hr.png")  # doctest: +SKIP
    """
    if not results:
        raise ValueError("results: nothing to plot (empty list)")
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(
            "plot_hit_ratio needs matplotlib; install it with `pip install 'tiercache[lab]'`"
        ) from err

    by_trace: dict[object, list[dict]] = {}
    for row in results:
        by_trace.setdefault(row.get("trace"), []).append(row)

    num_plots = len(by_trace)
    fig = Figure(figsize=(6.4 * num_plots, 4.8), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, num_plots, squeeze=False)[0]
    for ax, (trace, rows) in zip(axes, by_trace.items()):
        _draw(ax, rows)
        if num_plots > 1:
            ax.set_title(str(trace))
    if title:
        fig.suptitle(title)

    path = Path(path)
    fig.savefig(path, format="png", dpi=120)
    return path


def _label(row: dict) -> str:
    policy = str(row["policy"])
    if "belady" in policy.lower():
        return _BELADY_LABEL
    prefetch = row.get("prefetch")
    if prefetch is not None and prefetch != "none":
        return f"{policy}+{prefetch}"
    return policy


_COLORS: dict = {}


def _color(name: str):
    """One colour per policy name, shared by tiercache's line and libCacheSim's."""
    if name not in _COLORS:
        from matplotlib import colormaps
        _COLORS[name] = colormaps["tab10"](len(_COLORS) % 10)
    return _COLORS[name]


def _draw(ax, rows: list[dict]) -> None:
    # One line per (policy, prefetch); several Belady rows share one legend entry.
    lines: dict[tuple[str, object], list[dict]] = {}
    for row in rows:
        lines.setdefault((row["policy"], row.get("prefetch")), []).append(row)

    belady_labelled = False
    for (policy, _prefetch), points in lines.items():
        points = sorted(points, key=lambda r: r["budget_bytes"])
        x_mib = [r["budget_bytes"] / _MIB for r in points]
        y = [r["hit_ratio"] for r in points]
        label = _label(points[0])
        if label == _BELADY_LABEL:
            ax.plot(
                x_mib, y, color="black", linestyle="--", linewidth=3, zorder=10,
                label=None if belady_labelled else label,
            )
            belady_labelled = True
        elif policy.startswith("libcachesim:"):  # reference lines: thin and dotted
            ax.plot(x_mib, y, color=_color(policy.split(":", 1)[1]), linestyle=":", linewidth=1.2, label=label)
        else:
            ax.plot(x_mib, y, color=_color(policy), marker="o", markersize=3, linewidth=1.8, label=label)

    ax.set_xscale("log", base=2)
    ax.set_xlabel("device budget (MiB)")
    ax.set_ylabel("device hit ratio")
    ax.set_ylim(0.0, 1.02)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")
