"""The picture of a pipeline's schedule (matplotlib, imported on first use).

:func:`plot_pipeline` draws ``md.explain``'s pipeline entry as a grid: one row per stage, one
column per tick, each cell labelled with the microbatch the stage works on at that tick (GPipe:
stage ``s`` takes microbatch ``t - s`` at tick ``t``); idle ticks (the bubble) stay blank. The
forward ticks come first, then the backward pass, which autodiff runs as the same ticks in reverse
(the last stage starts it). A 1F1B entry is drawn as its ``M + 2S - 2`` ticks, each cell halved:
the forward phase left, the backward phase right (hatched). The title gives stages, microbatches,
ticks and the bubble fraction, and, from a full report, the bytes the ppermutes between stages move
per device.
"""

from __future__ import annotations

from .plots import _colors, _new_figure
from .units import fmt_bytes

__all__ = ["plot_pipeline", "schedule_grid", "one_f_one_b_grid"]


def schedule_grid(stages: int, microbatches: int, backward: bool = True) -> list[list]:
    """``grid[stage][column]``: the microbatch a stage works on at each tick (``None``: idle), the
    ``M + S - 1`` forward ticks then (``backward``) the same ticks in reverse."""
    ticks = microbatches + stages - 1
    forward = [[t - s if 0 <= t - s < microbatches else None for t in range(ticks)] for s in range(stages)]
    return [row + row[::-1] if backward else row for row in forward]


def one_f_one_b_grid(stages: int, microbatches: int) -> list[list[tuple]]:
    """``grid[stage][tick]``: ``(forward, backward)`` microbatches of each tick of the 1F1B schedule
    (:mod:`meshdsl.ops.pipeline_1f1b`): stage ``s`` runs microbatch ``t - s`` forward (not the last
    stage: its forward pass is part of its backward phase) and ``t - (2S - 2 - s)`` backward."""
    def at(m):
        return m if 0 <= m < microbatches else None
    return [[(at(t - s) if s < stages - 1 else None, at(t - (2 * stages - 2 - s)))
             for t in range(microbatches + 2 * stages - 2)] for s in range(stages)]


def plot_pipeline(report, *, backward: bool = True, title: str | None = None):
    """A ``matplotlib.figure.Figure`` of the schedule of ``report`` (an ``md.Report`` with a pipeline,
    or its ``report.pipeline`` dict): stages x ticks, cells labelled by microbatch, the bubble blank."""
    from matplotlib.patches import Rectangle

    p = report if isinstance(report, dict) else report.pipeline
    if not p:
        raise ValueError("plot_pipeline: the report has no pipeline (no md.scan over a dim the layout splits)")
    stages, m, ticks = p["stages"], p["microbatches"], p["ticks"]
    if p["schedule"] == "1f1b":
        return _plot_1f1b(p, one_f_one_b_grid(stages, m), title or _title(report, p))
    grid = schedule_grid(stages, m, backward)
    columns = len(grid[0])
    fig = _new_figure(figsize=(max(4.0, 0.42 * columns + 1.6), 0.5 * stages + 1.5), layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(m)
    for s, row in enumerate(grid):
        for c, mb in enumerate(row):
            phase_back = c >= ticks
            face = "white" if mb is None else colors[mb]
            ax.add_patch(Rectangle((c, stages - 1 - s), 1, 1, facecolor=face, edgecolor="0.6",
                                   hatch="//" if phase_back and mb is not None else None, alpha=0.85))
            if mb is not None:
                ax.text(c + 0.5, stages - 0.5 - s, str(mb), ha="center", va="center", fontsize=8)
    if backward:
        ax.axvline(ticks, color="black", lw=1.5)
        ax.text(ticks / 2, stages + 0.15, "forward", ha="center", va="bottom", fontsize=9)
        ax.text(ticks * 1.5, stages + 0.15, "backward (hatched)", ha="center", va="bottom", fontsize=9)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, stages + 0.7)
    ax.set_yticks([stages - 0.5 - s for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xticks([c + 0.5 for c in range(columns)], [str(c if c < ticks else 2 * ticks - 1 - c) for c in range(columns)],
                  fontsize=7)
    ax.set_xlabel(f"tick (over {p['axis']}; blank: bubble)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or _title(report, p), fontsize=10)
    return fig


def _plot_1f1b(p, grid, title):
    from matplotlib.patches import Rectangle

    stages, m, ticks = p["stages"], p["microbatches"], p["ticks"]
    fig = _new_figure(figsize=(max(4.0, 0.42 * ticks + 1.6), 0.5 * stages + 1.5), layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(m)
    for s, row in enumerate(grid):
        for t, pair in enumerate(row):
            for half, mb in enumerate(pair):   # forward phase left, backward phase right (hatched)
                ax.add_patch(Rectangle((t + 0.5 * half, stages - 1 - s), 0.5, 1, edgecolor="0.6", alpha=0.85,
                                       facecolor="white" if mb is None else colors[mb],
                                       hatch="//" if half and mb is not None else None))
                if mb is not None:
                    ax.text(t + 0.25 + 0.5 * half, stages - 0.5 - s, str(mb), ha="center", va="center", fontsize=7)
    ax.set_xlim(0, ticks)
    ax.set_ylim(0, stages + 0.2)
    ax.set_yticks([stages - 0.5 - s for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xticks([t + 0.5 for t in range(ticks)], [str(t) for t in range(ticks)], fontsize=7)
    ax.set_xlabel(f"tick (over {p['axis']}; left: forward, right hatched: backward; blank: idle)")
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title, fontsize=10)
    return fig


def _title(report, p) -> str:
    text = (f"{p['schedule']}: {p['stages']} stages, {p['microbatches']} microbatches, {p['ticks']} ticks, "
            f"bubble {p['bubble_fraction']:.0%}")
    if isinstance(report, dict):
        return text
    permutes = [r for r in report.collectives if r.kind == "collective-permute" and r.op == "scan"]
    moved = sum(r.total_bytes for r in permutes)
    return text + f"\nppermutes between stages: {sum(r.count for r in permutes)}x, {fmt_bytes(moved)} per device"
