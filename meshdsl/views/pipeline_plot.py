"""The picture of a pipeline's schedule (matplotlib, imported on first use).

:func:`plot_pipeline` draws ``md.explain``'s pipeline entry as a grid: one row per stage, one
column per tick, each cell labelled with the microbatch the stage works on at that tick (GPipe:
stage ``s`` takes microbatch ``t - s`` at tick ``t``); idle ticks (the bubble) stay blank. The
forward ticks come first, then the backward pass, which autodiff runs as the same ticks in reverse
(the last stage starts it). A circular entry (``repeats`` ``R``) is drawn the same way over its
``R M + S - 1`` ticks: stage ``s`` works on item ``k = t - s``, repeat ``k // M`` of microbatch
``k mod M``; a cell reads ``m`` on a microbatch's first repeat and ``m·r`` on its repeat ``r``
(colored by microbatch, a lighter shade per later repeat). A 1F1B entry is drawn as its
``M + 2S - 2`` ticks, each cell halved: the forward phase left, the backward phase right (hatched).
The title gives stages, microbatches (and repeats), ticks and the bubble fraction, and, from a full
report, the bytes the ppermutes between stages move per device (circular: and the bytes of moving
the chunks to their stage once per step, apart).
"""

from __future__ import annotations

from .plots import _colors, _new_figure
from ..names.units import fmt_bytes

__all__ = ["plot_pipeline", "schedule_grid", "one_f_one_b_grid"]


def schedule_grid(stages: int, microbatches: int, backward: bool = True, repeats: int = 1) -> list[list]:
    """``grid[stage][column]``: the microbatch a stage works on at each tick (``None``: idle), the
    ``R M + S - 1`` forward ticks then (``backward``) the same ticks in reverse. With ``repeats``
    ``R > 1`` (the circular schedule) a cell is ``(microbatch, repeat)``: stage ``s`` works on item
    ``k = t - s``, repeat ``k // M`` of microbatch ``k mod M``."""
    items = repeats * microbatches

    def cell(k):
        if not 0 <= k < items:
            return None
        return k if repeats == 1 else (k % microbatches, k // microbatches)
    forward = [[cell(t - s) for t in range(items + stages - 1)] for s in range(stages)]
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
    or its ``report.pipeline`` dict): stages x ticks, cells labelled by microbatch (circular: and
    repeat), the bubble blank."""
    from matplotlib.patches import Rectangle

    p = report if isinstance(report, dict) else report.pipeline
    if not p:
        raise ValueError("plot_pipeline: the report has no pipeline (no md.scan over a dim the layout splits)")
    stages, m, ticks, repeats = p["stages"], p["microbatches"], p["ticks"], p.get("repeats", 1)
    if p["schedule"] == "1f1b":
        return _plot_1f1b(p, one_f_one_b_grid(stages, m), title or _title(report, p))
    grid = schedule_grid(stages, m, backward, repeats)
    columns = len(grid[0])
    fig = _new_figure(figsize=(max(4.0, (0.42 if repeats == 1 else 0.5) * columns + 1.6), 0.5 * stages + 1.5),
                      layout="constrained")
    ax = fig.add_subplot()
    colors = _colors(m)
    for s, row in enumerate(grid):
        for c, item in enumerate(row):
            mb, r = item if isinstance(item, tuple) else (item, 0)
            face = "white" if mb is None else _shade(colors[mb], r, repeats)
            ax.add_patch(Rectangle((c, stages - 1 - s), 1, 1, facecolor=face, edgecolor="0.6",
                                   hatch="//" if c >= ticks and mb is not None else None, alpha=0.85))
            if mb is not None:
                ax.text(c + 0.5, stages - 0.5 - s, f"{mb}·{r}" if r else str(mb), ha="center", va="center",
                        fontsize=8 if repeats == 1 else 7)
    if backward:
        ax.axvline(ticks, color="black", lw=1.5)
        ax.text(ticks / 2, stages + 0.15, "forward", ha="center", va="bottom", fontsize=9)
        ax.text(ticks * 1.5, stages + 0.15, "backward (hatched)", ha="center", va="bottom", fontsize=9)
    ax.set_xlim(0, columns)
    ax.set_ylim(0, stages + 0.7)
    ax.set_yticks([stages - 0.5 - s for s in range(stages)], [f"stage {s}" for s in range(stages)])
    ax.set_xticks([c + 0.5 for c in range(columns)], [str(c if c < ticks else 2 * ticks - 1 - c) for c in range(columns)],
                  fontsize=7)
    ax.set_xlabel(f"tick (over {p['axis']}; blank: bubble"
                  + ("; m·r: microbatch m on its repeat r, first repeat: m)" if repeats > 1 else ")"))
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    ax.set_title(title or _title(report, p), fontsize=10)
    return fig


def _shade(color, repeat: int, repeats: int):
    """``color`` for a microbatch's first repeat, mixed towards white for the later ones."""
    mix = 0.6 * repeat / repeats
    return tuple(c + (1 - c) * mix for c in color[:3]) + tuple(color[3:])


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
    repeats = f"{p['repeats']} repeats, " if "repeats" in p else ""
    text = (f"{p['schedule']}: {p['stages']} stages, {p['microbatches']} microbatches, {repeats}{p['ticks']} ticks, "
            f"bubble {p['bubble_fraction']:.0%}")
    if isinstance(report, dict):
        return text
    permutes = [r for r in report.collectives if r.kind == "collective-permute" and r.op == "scan"]
    chunks = [r for r in permutes if "chunks to their circular stage" in r.tensor]
    ring = [r for r in permutes if r not in chunks]
    text += (f"\nppermutes between stages: {sum(r.count for r in ring)}x, "
             f"{fmt_bytes(sum(r.total_bytes for r in ring))} per device")
    if chunks:
        text += (f"; chunks to their stage: {sum(r.count for r in chunks)}x, "
                 f"{fmt_bytes(sum(r.total_bytes for r in chunks))}")
    return text
