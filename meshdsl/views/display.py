"""Notebook views of meshdsl objects: what a tensor is and where it lives, what a layout costs.

* :func:`named_array_html` - a NamedArray as a small table: dims and sizes, dtype, the parameter
  mark, and its placement when one is known: inside ``md.lower`` the rewriter's placement (split
  axes, pending sums); outside, the jax sharding of the global array (``md.place`` or an output of
  ``md.lower``), read back as mesh axes per dim with the block each device holds.
* :func:`report_html` - an ``md.explain`` Report: totals, bytes per collective kind with their
  share, the largest collectives, and every collective behind a disclosure.
* :func:`reports_table` - several reports side by side (layout comparison), as a :class:`Table`
  that renders as markdown or HTML without pandas.
* :func:`register_treescope` - teach treescope (if installed) to render NamedArrays as arrays with
  named axes and their sharding.

Pictures (matplotlib) are in :mod:`meshdsl.views.plots`.
"""

from __future__ import annotations

import html
import math

import jax

from ..costmodel.cost import KINDS
from .explain import ROW_HEAD, Report, compiled_note, row_cells
from ..names.named import NamedArray
from ..names.tracing import current
from ..names.units import fmt_bytes as _fmt_bytes
from ..names.units import fmt_flops as _fmt_flops

__all__ = ["KIND_COLORS", "Table", "named_array_html", "placement_of", "register_treescope", "report_html",
           "reports_table"]

# One color per collective kind, shared by the HTML views and the plots.
KIND_COLORS = {"all-reduce": "#4c78a8", "all-gather": "#f58518", "reduce-scatter": "#54a24b",
               "all-to-all": "#e45756", "ragged-all-to-all": "#ff9da6", "collective-permute": "#b279a2"}

_esc = html.escape
_CELL = "padding:2px 8px;border:1px solid #ddd;text-align:center"


# -- NamedArray ------------------------------------------------------------------------------------


def placement_of(x) -> dict | None:
    """Where ``x``'s value lives, as far as it can be known; None for an unplaced global array.

    Returns ``{"source", "mesh": {axis: size}, "axes": per-dim tuple of mesh axes, "block": local
    block shape, "pending": sorted axes of a pending sum}``. ``source`` is ``"rewriter"`` (inside
    ``md.lower``) or ``"sharding"`` (a global array with a jax ``NamedSharding``).
    """
    arr = x.raw
    if x.placement is not None:
        ctx = current()
        m = getattr(ctx, "mesh", None)
        if m is None:
            return {"source": "rewriter", "mesh": {}, "axes": tuple(x.placement.axes),
                    "block": tuple(getattr(arr, "shape", ())), "pending": sorted(x.placement.pending)}
        parts = [m.parts(axes) for axes in x.placement.axes]   # factor axes as mesh axes (or parts)
        mesh = {**m.shape, **{text: size for p in parts for text, size in p}}
        return {"source": "rewriter", "mesh": mesh, "axes": tuple(tuple(t for t, _ in p) for p in parts),
                "block": tuple(getattr(arr, "shape", ())), "pending": sorted(m.collapse(sorted(
                    x.placement.pending, key=m.factor_axes.index)))}
    sharding = getattr(arr, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if spec is None or not hasattr(sharding, "mesh"):
        return None
    entries = list(spec) + [None] * (len(x.dims) - len(spec))
    axes = tuple(() if e is None else ((e,) if isinstance(e, str) else tuple(e)) for e in entries)
    mesh = {str(k): int(v) for k, v in sharding.mesh.shape.items()}
    block = tuple(d.size // math.prod(mesh[a] for a in ax) for d, ax in zip(x.dims, axes))
    return {"source": "sharding", "mesh": mesh, "axes": axes, "block": block, "pending": []}


def _array_kind(arr) -> str:
    if isinstance(arr, jax.core.Tracer):
        return "traced"
    if isinstance(arr, jax.ShapeDtypeStruct):
        return "abstract (shapes only)"
    devices = getattr(getattr(arr, "sharding", None), "device_set", None)
    if devices is not None and len(devices) == 1:
        (dev,) = devices
        return f"on {dev.platform}:{dev.id}"
    return ""


def named_array_html(x) -> str:
    """A NamedArray as a small table: dims and sizes, dtype, parameter mark, placement if known."""
    arr = x.raw
    dtype = _esc(str(getattr(arr, "dtype", "?")))
    where = placement_of(x)
    badges = [f"<code>NamedArray</code> <b>{dtype}</b>"]
    if x.is_param:
        badges.append("<span style='background:#fde9c8;padding:0 4px;border-radius:3px'>parameter</span>")
    kind = _array_kind(arr)
    if kind:
        badges.append(_esc(kind))
    nbytes = x.size * getattr(getattr(arr, "dtype", None), "itemsize", 0)
    if nbytes:
        badges.append(f"{_fmt_bytes(nbytes)} global")
    head = "<tr><th style='text-align:left'>dim</th>" + "".join(
        f"<td style='{_CELL}'><b>{_esc(d.name)}</b></td>" for d in x.dims) + "</tr>"
    rows = [head, "<tr><th style='text-align:left'>size</th>" + "".join(
        f"<td style='{_CELL}'>{d.size}</td>" for d in x.dims) + "</tr>"]
    foot = ""
    if where is not None:
        mesh = where["mesh"]
        split = ["+".join(f"{a}({mesh.get(a, '?')})" for a in ax) or "—" for ax in where["axes"]]
        rows.append("<tr><th style='text-align:left'>split over</th>" + "".join(
            f"<td style='{_CELL}'>{_esc(s)}</td>" for s in split) + "</tr>")
        rows.append("<tr><th style='text-align:left'>block</th>" + "".join(
            f"<td style='{_CELL}'>{n}</td>" for n in where["block"]) + "</tr>")
        used = {a for ax in where["axes"] for a in ax}
        replicated = [a for a in mesh if a not in used and a not in where["pending"]]
        parts = ["mesh " + _esc(" x ".join(f"{k}:{v}" for k, v in mesh.items()))] if mesh else []
        if where["source"] == "rewriter":
            parts.insert(0, "inside md.lower: <code>x.array</code> is this device's block")
        if replicated:
            parts.append("replicated over " + _esc(", ".join(replicated)))
        if where["pending"]:
            parts.append("<b>pending sum</b> over " + _esc(", ".join(where["pending"])))
        foot = "<div style='color:#555'>" + " &middot; ".join(parts) + "</div>"
    body = "".join(rows) if x.dims else "<tr><td>scalar</td></tr>"
    return (f"<div class='meshdsl-named'><div>{' &middot; '.join(badges)}</div>"
            f"<table style='border-collapse:collapse'>{body}</table>{foot}</div>")


# -- explain reports -------------------------------------------------------------------------------


def _bar(fraction: float, color: str) -> str:
    width = max(0.0, min(1.0, fraction)) * 100
    return (f"<div style='background:#eee;width:120px;height:10px'><div style='background:{color};"
            f"width:{width:.1f}%;height:10px'></div></div>")


def report_html(report, top: int = 8) -> str:
    """An ``md.explain`` Report as HTML: totals, bytes per kind with their share, the ``top`` largest
    collectives, and every collective in a disclosure."""
    total, mem = report.total_bytes, report.memory
    head = (f"<div><b>mesh</b> {_esc(report.mesh)} &middot; <b>layout</b> <code>{_esc(report.layout)}</code></div>"
            f"<div>communication <b>{_fmt_bytes(total)}</b>/device &middot; matmul <b>{_fmt_flops(report.flops)}"
            f"</b>/device &middot; memory <b>{_fmt_bytes(mem['peak'])}</b>/device (arguments "
            f"{_fmt_bytes(mem['arguments'])}, outputs {_fmt_bytes(mem.get('outputs', 0))}, temporaries "
            f"{_fmt_bytes(mem['temporaries'])}){_esc(compiled_note(report))}</div>")
    summary = report.summary()
    rows = "".join(
        f"<tr><td style='{_CELL}'><span style='color:{KIND_COLORS.get(k, '#888')}'>&#9632;</span> {k}</td>"
        f"<td style='{_CELL}'>{v['count']}</td><td style='{_CELL}'>{_fmt_bytes(v['bytes'])}</td>"
        f"<td style='{_CELL}'>{_bar(v['bytes'] / total if total else 0, KIND_COLORS.get(k, '#888'))}</td></tr>"
        for k, v in summary.items()) or f"<tr><td style='{_CELL}' colspan=4>no communication</td></tr>"
    out = [head, "<table style='border-collapse:collapse'><tr><th>kind</th><th>count</th><th>bytes/device</th>"
           f"<th>share</th></tr>{rows}</table>"]
    if report.collectives:
        phases = {}
        for r in report.collectives:
            phases[r.phase] = phases.get(r.phase, 0.0) + r.total_bytes
        out.append("<div>by phase: " + " &middot; ".join(f"{_esc(p)} {_fmt_bytes(b)}" for p, b in phases.items())
                   + "</div>")
        cols = "".join(f"<th>{h}</th>" for h in ROW_HEAD)

        def table(records):
            body = "".join("<tr>" + "".join(f"<td style='{_CELL}'>{_esc(c)}</td>" for c in row_cells(r)) + "</tr>"
                           for r in records)
            return f"<table style='border-collapse:collapse;font-size:90%'><tr>{cols}</tr>{body}</table>"

        largest = sorted(report.collectives, key=lambda r: -r.total_bytes)[:top]
        if len(report.collectives) > top:
            out.append(f"<div><b>largest {len(largest)}</b> of {len(report.collectives)} collectives</div>")
        out.append(table(largest if len(report.collectives) > top else report.collectives))
        if len(report.collectives) > top:
            out.append(f"<details><summary>every collective ({len(report.collectives)})</summary>"
                       f"{table(report.collectives)}</details>")
    return "<div class='meshdsl-report'>" + "".join(out) + "</div>"


# -- several reports -------------------------------------------------------------------------------


class Table:
    """Rows of a comparison: ``records`` (raw numbers, one dict per row) and their formatted text.
    Renders as markdown (``str``, ``to_markdown``) or HTML (``to_html``, notebooks)."""

    def __init__(self, columns, rows, records):
        self.columns, self.rows, self.records = list(columns), [list(r) for r in rows], records

    def to_markdown(self) -> str:
        right = {c for c in self.columns if c not in ("group", "layout", "mesh", "rules")}
        lines = ["| " + " | ".join(self.columns) + " |",
                 "|" + "".join(" ---: |" if c in right else " --- |" for c in self.columns)]
        lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in self.rows]
        return "\n".join(lines)

    def to_html(self) -> str:
        head = "".join(f"<th style='{_CELL}'>{_esc(c)}</th>" for c in self.columns)
        body = "".join("<tr>" + "".join(f"<td style='{_CELL}'>{_esc(c)}</td>" for c in row) + "</tr>"
                       for row in self.rows)
        return f"<table style='border-collapse:collapse'><tr>{head}</tr>{body}</table>"

    _repr_html_ = to_html
    __str__ = to_markdown

    def __repr__(self) -> str:
        return self.to_markdown()


def _flatten(reports) -> list[tuple]:
    """``{name: Report}`` or ``{group: {name: Report}}`` -> [(group or None, name, Report)]."""
    out = []
    for key, value in reports.items():
        if isinstance(value, dict):
            out += [(key, name, r) for name, r in value.items()]
        else:
            out.append((None, key, value))
    return out


def reports_table(reports) -> Table:
    """Compare ``md.explain`` reports: ``{name: Report}``, or ``{group: {name: Report}}`` (e.g. one
    group per mesh). Per row: bytes moved per device in total and per collective kind, collectives
    executed, matmul FLOPs, peak memory per device, and the layout rules."""
    items = _flatten(reports)
    kinds = [k for k in KINDS if any(k in r.summary() for _, _, r in items)]
    grouped = any(g is not None for g, _, _ in items)
    columns = (["group"] if grouped else []) + ["layout", "mesh", "communication/device", *kinds,
                                                "collectives", "matmul/device", "memory/device", "rules"]
    rows, records = [], []
    for group, name, r in items:
        s = r.summary()
        rec = {"group": group, "layout": name, "mesh": r.mesh, "bytes": r.total_bytes,
               **{k: s.get(k, {}).get("bytes", 0.0) for k in kinds},
               "collectives": sum(v["count"] for v in s.values()), "flops": r.flops,
               "memory": r.memory["peak"], "rules": r.layout}
        records.append(rec)
        row = ([str(group)] if grouped else []) + [str(name), r.mesh, _fmt_bytes(rec["bytes"])]
        row += [_fmt_bytes(rec[k]) if rec[k] else "-" for k in kinds]
        row += [str(rec["collectives"]), _fmt_flops(r.flops), _fmt_bytes(rec["memory"]), r.layout]
        rows.append(row)
    return Table(columns, rows, records)


# -- treescope -------------------------------------------------------------------------------------


def register_treescope() -> bool:
    """Render NamedArrays in treescope as arrays with named axes (and their sharding). Returns False
    when treescope is not installed. Idempotent."""
    try:
        from treescope import ndarray_adapters, repr_lib, type_registries
    except ImportError:
        return False

    class NamedArrayAdapter(ndarray_adapters.NDArrayAdapter):
        """Delegates the data to the wrapped array's adapter; axes carry the dim names."""

        @staticmethod
        def _inner(x):
            type_registries.update_registries_for_imports()  # treescope sets up jax's adapter lazily
            return type_registries.lookup_ndarray_adapter(x.raw)

        def get_axis_info_for_array_data(self, array):
            return tuple(ndarray_adapters.NamedPositionalAxisInfo(i, d.name, d.size)
                         for i, d in enumerate(array.dims))

        def get_array_data_with_truncation(self, array, mask, edge_items_per_axis):
            mask = mask.raw if isinstance(mask, NamedArray) else mask
            return self._inner(array).get_array_data_with_truncation(array.raw, mask, edge_items_per_axis)

        def get_array_summary(self, array, fast):
            mark = " param" if array.is_param else ""
            return f"NamedArray {array.dtype}[{array.dims}]{mark}"

        def get_numpy_dtype(self, array):
            return self._inner(array).get_numpy_dtype(array.raw)

        def get_sharding_info_for_array_data(self, array):
            return self._inner(array).get_sharding_info_for_array_data(array.raw)

        def should_autovisualize(self, array):
            inner = self._inner(array)
            return inner is not None and inner.should_autovisualize(array.raw)

    def render(node, path, subtree_renderer):
        if not isinstance(node, NamedArray):
            return NotImplemented
        where = placement_of(node)
        attributes = {"dims": str(node.dims), "is_param": node.is_param}
        if where is not None:
            attributes["split"] = {d.name: "+".join(a) for d, a in zip(node.dims, where["axes"]) if a}
        attributes["array"] = node.raw
        return repr_lib.render_object_constructor(NamedArray, attributes, path, subtree_renderer)

    type_registries.NDARRAY_ADAPTER_REGISTRY[NamedArray] = NamedArrayAdapter()
    type_registries.TREESCOPE_HANDLER_REGISTRY[NamedArray] = render
    return True


# Notebook views: installed here, so values and reports do not depend on the display layer.
NamedArray._repr_html_ = named_array_html
Report._repr_html_ = report_html
