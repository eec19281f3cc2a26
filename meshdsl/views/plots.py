"""Pictures of layouts and of what they cost (matplotlib, imported on first use).

* :func:`device_blocks` - for every device of a mesh, the block of a tensor it holds under a layout
  (index ranges per dim), computed from the layout alone, so it works for abstract meshes too. It
  agrees with jax's ``NamedSharding.devices_indices_map`` for placed arrays.
* :func:`plot_placement` - the mesh as a grid of devices (axes labelled with mesh axis names and
  sizes; a 3-D mesh is one grid per index of its first axis), each device coloured by the block it
  holds and labelled with its index ranges, next to the tensor cut into those blocks. Devices of
  one colour hold the same block (the tensor is replicated over the axes that split none of its dims).
* :func:`plot_reports` - ``md.explain`` reports side by side: bytes moved per device stacked by
  collective kind (optionally with measured bytes from ``hlo_comm``), memory and matmul FLOPs per
  device.

Every function returns a ``matplotlib.figure.Figure`` made without pyplot (no global state, no
double display): it shows itself in a notebook as PNG whether or not a matplotlib backend is set
up, and saves with ``fig.savefig(path)``.
"""

from __future__ import annotations

import dataclasses
import functools
import io
import itertools
import math

import numpy as np

from ..costmodel.cost import KINDS
from ..names.dims import Dim, Shape, parse_dims
from .display import KIND_COLORS
from ..names.errors import ShapeError
from ..names.layout import Layout
from ..names.mesh import Mesh
from ..names.named import NamedArray

__all__ = ["DeviceBlock", "device_blocks", "plot_placement", "plot_reports"]


@dataclasses.dataclass(frozen=True)
class DeviceBlock:
    """One device's share of a tensor: mesh ``coords`` (one index per mesh axis), ``device`` (the
    jax device id; the position in the mesh for an abstract mesh), ``block`` (``(start, stop)`` per
    dim of the tensor) and ``block_id`` (the block's number along each dim; 0 for a whole dim)."""

    coords: tuple
    device: int
    block: tuple
    block_id: tuple


def _as_dims(x_or_dims) -> Shape:
    if isinstance(x_or_dims, NamedArray):
        return x_or_dims.dims
    if isinstance(x_or_dims, Shape):
        return x_or_dims
    if isinstance(x_or_dims, Dim):
        return Shape([x_or_dims])
    if isinstance(x_or_dims, str):
        specs = parse_dims(x_or_dims, what="md.plot_placement")
        missing = [n for n, s in specs if s is None]
        if missing:
            raise ShapeError(f"md.plot_placement: dims {missing} in {x_or_dims!r} have no size; write them "
                             "name:size, e.g. 'batch:8 d_model:16'")
        return Shape([Dim(n, s) for n, s in specs])
    return Shape([d if isinstance(d, Dim) else Dim(*d) for d in x_or_dims])


def _as_mesh(mesh) -> Mesh:
    return mesh if isinstance(mesh, Mesh) else Mesh.abstract(mesh)


def _as_layout(layout) -> Layout:
    if isinstance(layout, Layout):
        return layout
    rules, _, params = layout.partition("|")
    params = params.strip()
    params = params[len("params"):].strip() if params.startswith("params") else params
    return Layout.parse(rules, params=params or None)


def device_blocks(x_or_dims, mesh, layout, *, storage: bool | None = None) -> list[DeviceBlock]:
    """The block of ``x_or_dims`` each device of ``mesh`` holds under ``layout``.

    ``x_or_dims``: a NamedArray, a Shape, Dims, or ``"batch:8 d_model:16"``. ``mesh``: an ``md.Mesh``
    (abstract ones too) or ``{"data": 2, "model": 4}``. ``layout``: an ``md.Layout`` or its string
    (``"batch:data | params d_model:data"``). ``storage``: place the tensor as a parameter at rest
    (``params=`` rules too); default: ``x.is_param`` for a NamedArray, else False.
    """
    dims, mesh, layout = _as_dims(x_or_dims), _as_mesh(mesh), _as_layout(layout)
    if storage is None:
        storage = isinstance(x_or_dims, NamedArray) and x_or_dims.is_param
    layout.check_mesh(mesh)
    axes = layout.tensor_axes(dims, mesh, storage=storage, what="md.plot_placement: tensor")
    sizes = mesh.shape
    devices = None if mesh.is_abstract else mesh.jax_mesh.devices
    out = []
    for linear, coords in enumerate(itertools.product(*(range(n) for n in sizes.values()))):
        at = dict(zip(sizes, coords))
        block, block_id = [], []
        for d, ax in zip(dims, axes):
            index = 0
            for a in ax:  # major axis first
                index = index * sizes[a] + at[a]
            width = d.size // math.prod(sizes[a] for a in ax)
            block.append((index * width, (index + 1) * width))
            block_id.append(index)
        device = linear if devices is None else int(devices[coords].id)
        out.append(DeviceBlock(tuple(coords), device, tuple(block), tuple(block_id)))
    return out


@functools.cache
def _figure_class():
    from matplotlib.figure import Figure

    class PlotFigure(Figure):
        """A Figure that displays itself in notebooks (``_repr_png_``) without pyplot."""

        def _repr_png_(self):
            buf = io.BytesIO()
            self.savefig(buf, format="png", bbox_inches="tight")
            return buf.getvalue()

    return PlotFigure


def _new_figure(**kwargs):
    return _figure_class()(**kwargs)


# -- placement picture -----------------------------------------------------------------------------


def _colors(n: int):
    from matplotlib import colormaps
    if n <= 10:
        return [colormaps["tab10"](i) for i in range(n)]
    if n <= 20:
        return [colormaps["tab20"](i) for i in range(n)]
    return [colormaps["turbo"](0.08 + 0.84 * i / (n - 1)) for i in range(n)]


def _block_text(dims, axes, b: DeviceBlock) -> str:
    """``dev 5`` and the index range of every split dim (``all`` when nothing is split)."""
    ranges = [f"{d.name} {lo}:{hi}" for d, ax, (lo, hi) in zip(dims, axes, b.block) if ax]
    return "\n".join([f"dev {b.device}", *(ranges or ["all"])])


def plot_placement(x_or_dims, mesh, layout, *, storage: bool | None = None, title: str | None = None,
                   tensor: bool = True, max_labels: int = 64, cell: float | None = None):
    """Draw which block of a tensor each device holds (see :func:`device_blocks` for the arguments).

    Left: the tensor cut into blocks along its split dims (up to two), each labelled with the
    devices holding it. Right: the mesh as a device grid - rows and columns are the last two mesh
    axes (a 1-D mesh is one row), one grid per index of the leading axes - each device coloured by
    its block and labelled with its device id and index ranges (labels only up to ``max_labels``
    devices). ``tensor=False`` leaves out the tensor panel; ``cell``: inches per device.
    """
    dims, mesh_, layout_ = _as_dims(x_or_dims), _as_mesh(mesh), _as_layout(layout)
    if storage is None:
        storage = isinstance(x_or_dims, NamedArray) and x_or_dims.is_param
    blocks = device_blocks(dims, mesh_, layout_, storage=storage)
    axes = layout_.tensor_axes(dims, mesh_, storage=storage)
    ids = sorted({b.block_id for b in blocks})
    color = dict(zip(ids, _colors(len(ids))))
    names, sizes = list(mesh_.shape), list(mesh_.shape.values())
    if len(names) == 1:
        names, sizes = ["", *names], [1, *sizes]
    ri, ci = len(names) - 2, len(names) - 1          # coordinates drawn as rows and columns
    if sizes[ri] > 16 and sizes[ri] > sizes[ci]:      # a long first axis reads better across
        ri, ci = ci, ri
    n_rows, n_cols = sizes[ri], sizes[ci]
    offset = len(names) - len(mesh_.shape)           # 1 for a 1-D mesh (its fake row axis)
    panels = list(itertools.product(*(range(n) for n in sizes[:-2])))
    split = [i for i, ax in enumerate(axes) if ax]
    show_tensor = tensor and len(split) <= 2
    across = n_cols * len(panels)
    if cell is None:
        cell = min(1.15, 10.0 / across, 6.0 / n_rows)
    labels = len(blocks) <= max_labels and cell >= 0.8

    width = cell * across + 0.4 * (len(panels) - 1) + (3.2 if show_tensor else 0) + 0.9
    fig = _new_figure(figsize=(max(width, 4.5), max(cell * n_rows, 2.4 if show_tensor else 1.2) + 1.6),
                      layout="constrained")
    ratios = ([2.6] if show_tensor else []) + [cell * n_cols] * len(panels)
    grid = fig.add_gridspec(1, len(ratios), width_ratios=ratios)
    fontsize = max(5.0, min(8.5, 10 * cell / 1.15))

    if show_tensor:
        _draw_tensor(fig.add_subplot(grid[0, 0]), dims, axes, split, blocks, color, mesh_)
    geometry = _Grid(names, ri, ci, n_rows, n_cols, offset, cell, fontsize, labels)
    for k, lead in enumerate(panels):
        _draw_devices(fig.add_subplot(grid[0, k + int(show_tensor)]), lead, geometry, blocks, color, dims, axes)

    fig.suptitle(_placement_title(dims, axes, blocks, len(ids), mesh_, storage, title), fontsize=10)
    return fig


@dataclasses.dataclass
class _Grid:
    """How the mesh is drawn: which mesh axes are rows and columns, and the sizes of things."""

    names: list
    ri: int
    ci: int
    n_rows: int
    n_cols: int
    offset: int
    cell: float
    fontsize: float
    labels: bool


def _draw_devices(ax, lead, g: _Grid, blocks, color, dims, axes):
    """One panel of the device grid (one index of the leading mesh axes)."""
    from matplotlib.patches import Rectangle

    lead_names = g.names[:-2]
    for b in blocks:
        coords = (0,) * g.offset + b.coords
        if lead_names and coords[:len(lead_names)] != lead:
            continue
        r, c = coords[g.ri], coords[g.ci]
        ax.add_patch(Rectangle((c, r), 1, 1, facecolor=color[b.block_id], edgecolor="white",
                               lw=1.5 if g.cell > 0.3 else 0.3))
        if g.labels:
            ax.text(c + 0.5, r + 0.5, _block_text(dims, axes, b), ha="center", va="center",
                    fontsize=g.fontsize, color="black",
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.75))
    ax.set_xlim(0, g.n_cols), ax.set_ylim(g.n_rows, 0), ax.set_aspect("equal")
    step_c, step_r = max(1, g.n_cols // 16), max(1, g.n_rows // 16)
    ax.set_xticks([i + 0.5 for i in range(0, g.n_cols, step_c)], [str(i) for i in range(0, g.n_cols, step_c)])
    ax.set_yticks([i + 0.5 for i in range(0, g.n_rows, step_r)], [str(i) for i in range(0, g.n_rows, step_r)])
    ax.tick_params(length=0, labelsize=8)
    ax.xaxis.set_label_position("top"), ax.xaxis.tick_top()
    ax.set_xlabel(f"mesh axis {g.names[g.ci]} ({g.n_cols})")
    if g.names[g.ri]:
        ax.set_ylabel(f"mesh axis {g.names[g.ri]} ({g.n_rows})")
    else:
        ax.set_yticks([])
    if lead_names:
        ax.set_title(", ".join(f"{a} = {i}" for a, i in zip(lead_names, lead)), fontsize=9, y=-0.12, pad=-4)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _placement_title(dims, axes, blocks, n_ids, mesh, storage, title) -> str:
    used = {a for ax in axes for a in ax}
    replicated = [a for a in mesh.shape if a not in used]
    rule = ", ".join(f"{d.name}->{'+'.join(ax)}" for d, ax in zip(dims, axes) if ax) or "replicated"
    copies = len(blocks) // n_ids
    sub = f"{n_ids} block{'s' * (n_ids > 1)}, {copies} cop{'ies' if copies > 1 else 'y'} each"
    if replicated:
        sub += f" (replicated over {', '.join(replicated)})"
    head = title or f"[{dims}]{' stored (params rules)' if storage else ''} on mesh {mesh}"
    return f"{head}\n{rule}  ·  {sub}"


def _draw_tensor(ax, dims, axes, split, blocks, color, mesh):
    """The tensor as a rectangle cut along its (up to two) split dims, blocks labelled with devices."""
    from matplotlib.patches import Rectangle

    row_dim = split[0] if split else None
    col_dim = split[1] if len(split) > 1 else None
    n_r = math.prod(mesh.shape[a] for a in axes[row_dim]) if row_dim is not None else 1
    n_c = math.prod(mesh.shape[a] for a in axes[col_dim]) if col_dim is not None else 1
    holders = {}
    for b in blocks:
        holders.setdefault(b.block_id, []).append(b.device)
    for bid, devs in holders.items():
        r = bid[row_dim] if row_dim is not None else 0
        c = bid[col_dim] if col_dim is not None else 0
        ax.add_patch(Rectangle((c, r), 1, 1, facecolor=color[bid], edgecolor="white",
                               lw=1.5 if n_r * n_c <= 32 else 0.2))
        if n_r * n_c <= 32:
            who = ",".join(map(str, devs)) if len(devs) <= 4 else f"{len(devs)} devices"
            ax.text(c + 0.5, r + 0.5, f"dev {who}", ha="center", va="center", fontsize=7 if n_r * n_c > 16 else 8,
                    bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.75))
    ax.set_xlim(0, n_c), ax.set_ylim(n_r, 0)
    whole = [d for i, d in enumerate(dims) if i not in split[:2]]

    def ticks(n, dim):
        step = max(1, n // 8)
        return [i for i in range(0, n + 1, step)], [str(i * dim.size // n) for i in range(0, n + 1, step)]

    if col_dim is not None:
        ax.set_xticks(*ticks(n_c, dims[col_dim]))
        ax.set_xlabel(f"{dims[col_dim].name} ({dims[col_dim].size}) over {'+'.join(axes[col_dim])}")
    else:
        ax.set_xticks([])
        ax.set_xlabel(" ".join(f"{d.name}:{d.size}" for d in whole) + " (whole)" if whole else "")
    if row_dim is not None:
        ax.set_yticks(*ticks(n_r, dims[row_dim]))
        ax.set_ylabel(f"{dims[row_dim].name} ({dims[row_dim].size}) over {'+'.join(axes[row_dim])}")
    else:
        ax.set_yticks([])
    ax.tick_params(labelsize=8)
    ax.set_title("tensor blocks" + (f"\nwhole: {' '.join(d.name for d in whole)}" if whole and col_dim is not None
                                   else ""), fontsize=9)


# -- reports ---------------------------------------------------------------------------------------


def _unit(values, kind: str):
    big = max([abs(v) for v in values] + [0.0])
    if kind == "bytes":
        table = (("GiB", 2 ** 30), ("MiB", 2 ** 20), ("KiB", 2 ** 10), ("B", 1))
    else:
        table = (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3), ("FLOP", 1))
    return next((u, s) for u, s in table if big >= s or s == 1)


def _measured_bytes(m) -> dict:
    """kind -> bytes from an hlo_comm CommReport, its summary(), or {kind: bytes}."""
    summary = m.summary() if hasattr(m, "summary") else m
    out = {}
    for kind, v in summary.items():
        out[kind] = float(v.get("moved_bytes", v.get("bytes", 0.0)) if isinstance(v, dict) else v)
    return out


def plot_reports(reports, *, measured=None, log: bool = False, title: str | None = None):
    """Compare ``md.explain`` reports: ``{name: Report}``, or ``{group: {name: Report}}`` for one row
    of plots per group (e.g. per mesh). Columns: bytes moved per device stacked by collective kind,
    memory per device (arguments + peak temporaries), matmul FLOPs per device. ``measured``: the
    same keys mapping to ``hlo_comm`` reports (or ``{kind: bytes}``): drawn as black markers on the
    bytes bars. ``log``: logarithmic value axes.
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    groups = {k: v for k, v in reports.items()} if all(isinstance(v, dict) for v in reports.values()) \
        else {None: reports}
    measured = measured or {}
    if None in groups and measured:
        measured = {None: measured}
    n_bars = max(len(v) for v in groups.values())
    fig = _new_figure(figsize=(max(10.0, 3 * 0.55 * n_bars + 5), 3.2 * len(groups) + 0.6), layout="constrained")
    grid = fig.subplots(len(groups), 3, squeeze=False)
    kinds_seen = set()
    for row, (group, reps) in zip(grid, groups.items()):
        _plot_group(row, group, reps, measured.get(group) or {}, log, kinds_seen)
    for ax, name in zip(grid[0], ("communication", "memory (peak)", "compute")):
        ax.set_title(name, fontsize=10)
    handles = [Patch(color=KIND_COLORS[k], label=k) for k in KINDS if k in kinds_seen]
    if any(measured.values()):
        handles.append(Line2D([], [], marker="D", color="black", ls="none", label="measured (compiled HLO)"))
    handles += [Patch(color="#9d9d9d", label="memory: arguments"), Patch(color="#72b7b2", label="memory: temporaries")]
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 6), fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=11)
    return fig


def _plot_group(row, group, reps, measured, log, kinds_seen):
    """One row of :func:`plot_reports`: bytes by kind (and measured markers), memory, FLOPs."""
    names = list(reps)
    x = np.arange(len(names))
    summaries = [reps[n].summary() for n in names]
    meas = {n: _measured_bytes(m) for n, m in measured.items()}
    unit, scale = _unit([reps[n].total_bytes for n in names] + [sum(m.values()) for m in meas.values()], "bytes")
    bottom = np.zeros(len(names))
    for kind in KINDS:
        vals = np.array([s.get(kind, {}).get("bytes", 0.0) for s in summaries]) / scale
        if vals.any():
            kinds_seen.add(kind)
            row[0].bar(x, vals, bottom=bottom, color=KIND_COLORS[kind])
            bottom += vals
    for i, n in enumerate(names):
        if n in meas:
            row[0].plot([i], [sum(meas[n].values()) / scale], marker="D", color="black", ms=5, ls="none")
    _annotate(row[0], x, bottom)
    row[0].set_ylabel(f"bytes moved / device ({unit})" + (f"\n{group}" if group is not None else ""))

    mem_unit, mem_scale = _unit([reps[n].memory["peak"] for n in names], "bytes")
    args = np.array([reps[n].memory["arguments"] for n in names]) / mem_scale
    temps = np.array([reps[n].memory["temporaries"] + reps[n].memory.get("outputs", 0) for n in names]) / mem_scale
    row[1].bar(x, args, color="#9d9d9d")
    row[1].bar(x, temps, bottom=args, color="#72b7b2")
    _annotate(row[1], x, args + temps)
    row[1].set_ylabel(f"memory / device ({mem_unit})")

    f_unit, f_scale = _unit([reps[n].flops for n in names], "flops")
    flops = np.array([reps[n].flops for n in names]) / f_scale
    row[2].bar(x, flops, color="#eeca3b")
    _annotate(row[2], x, flops)
    row[2].set_ylabel(f"matmul / device ({f_unit})")
    for ax in row:
        ax.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
        ax.tick_params(axis="y", labelsize=8)
        ax.spines[["top", "right"]].set_visible(False)
        if log:
            ax.set_yscale("log")
            low, high = ax.get_ylim()
            ax.set_ylim(low, high * 2.5)
        else:
            ax.set_ylim(0, ax.get_ylim()[1] * 1.12)


def _annotate(ax, x, tops):
    for xi, top in zip(x, tops):
        ax.annotate("0" if top == 0 else f"{top:.3g}", (xi, top), xytext=(0, 6), textcoords="offset points",
                    ha="center", va="bottom", fontsize=7)
