"""Notebook views of meshdsl objects (HTML reprs)."""

from __future__ import annotations

import html

__all__ = ["named_array_html"]


def named_array_html(x) -> str:
    """A NamedArray as a small table: dims and sizes, dtype, parameter mark, placement if known."""
    dims = "".join(f"<td><b>{html.escape(d.name)}</b><br>{d.size}</td>" for d in x.dims)
    dtype = html.escape(str(getattr(x._array, "dtype", "?")))
    extra = " &middot; parameter" if x.is_param else ""
    if x.placement is not None:
        extra += f" &middot; {html.escape(x.placement.describe(x.dims))}"
    return (f"<div><code>NamedArray</code> {dtype}{extra}"
            f"<table><tr>{dims or '<td>scalar</td>'}</tr></table></div>")
