"""``md.scan``: ``lax.scan`` over a named dim (stacked layers), so compile time does not grow
with depth.

``md.scan(step, carry, xs, dim="layers")`` runs ``carry, y = step(carry, x)`` for each entry of
``dim``: every NamedArray in ``xs`` has ``dim``, each step sees it without; the ``ys`` come back
stacked along ``dim`` (first). Inside ``md.lower``:

* ``dim`` whole in the compute layout: one loop on every device (:mod:`meshdsl.ops.loop`); a
  ``params=`` rule may split it at rest: the stack is gathered once before the loop. Values the
  step captures from outside (the encoder output in a decoder stack, a position bias) are relaid
  outside the loop, once.
* ``dim`` split by the compute layout (``layers: pipe``): a pipeline over that mesh axis
  (:mod:`meshdsl.ops.pipeline`): each device runs its own layers on one microbatch per tick.

``remat=`` rematerialises the step (:mod:`meshdsl.ops.remat`): a policy by name, or ``"auto"``:
the planner chooses per loop, by the step's time under the memory budget.
"""

from __future__ import annotations

import jax

from ..platform import jaxcompat
from ..rewrite import param_gather
from ..rewrite.contexts import active
from ..names.errors import LayoutError, ShapeError, user_line
from ..names.named import is_named as _is_named
from . import loop, pipeline, pipeline_1f1b, remat as remats
from .common import decided

__all__ = ["scan"]


def scan(step, carry, xs, dim: str = "layers", *, reverse: bool = False, unroll: int = 1, head=None,
         schedule: str | None = None, remat: str | None = None):
    """Scan ``step`` over ``dim`` of the NamedArrays in ``xs``; returns ``(carry, ys)``.

    ``head``: a function of the final carry returning a loss with no dims, summed over the rows of
    the carry (a summed token loss, say), or ``(loss, aux)`` with ``aux`` values that are not
    differentiated (metrics); then ``(head(carry), ys)`` is returned. Under a pipeline with
    ``schedule="1f1b"`` it runs on the last stage for every microbatch (required there).
    ``schedule``: this scan's pipeline schedule where the layout splits ``dim`` (default: md.lower's);
    an encoder whose output feeds a later stack, say, runs ``"gpipe"`` under a 1F1B decoder.
    ``remat``: the step's remat policy (:mod:`meshdsl.ops.remat`; None: the step as written),
    ``"auto"``: the planner's choice of none, dots or full, by time under the memory budget
    (outside a planned lowering, and in a pipeline, ``"none"``)."""
    ctx = active()
    line = user_line(2)
    where = f"md.scan at {line}"
    if remat is not None:
        remats.checked(remat)
    x_leaves, x_tree = jax.tree_util.tree_flatten(xs, is_leaf=_is_named)
    lengths = set()
    for leaf in x_leaves:
        if not _is_named(leaf):
            raise ShapeError(f"{where}: xs must hold NamedArrays with dim {dim!r}, got {type(leaf).__name__}")
        if dim not in leaf.names:
            raise ShapeError(f"{where}: xs entry [{leaf.dims}] has no dim {dim!r} to scan over")
        lengths.add(leaf.dims[dim].size)
    if len(lengths) > 1:
        raise ShapeError(f"{where}: xs disagree on the size of {dim!r}: {sorted(lengths)}")
    if not lengths:
        raise ShapeError(f"{where}: xs has nothing to scan over")
    (length,) = lengths
    c_leaves, c_tree = jax.tree_util.tree_flatten(carry, is_leaf=_is_named)
    if ctx.explicit and ctx.layout_axes(dim):
        if reverse:
            raise LayoutError(f"{where}: the layout splits {dim!r} (a pipeline), which runs forward only; "
                              f"remove reverse=True or the rule for {dim!r}")
        with ctx.at("scan", line):
            step = remats.wrap(step, None if remat == remats.AUTO else remat)
            return pipeline.run(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, where, head, schedule)
    def run(ctx, c_leaves, x_leaves):
        policy = remat
        if remat == remats.AUTO:   # the planner's decision point (its first), its default keeping all
            policy = remats.auto_taken_as() or (
                decided(ctx, list(remats.choices(ctx.mesh.platform))) if ctx.explicit else "none")
        below = -1
        if ctx.explicit and ctx.planner is not None and ctx.params.name == "auto":
            # the planner's decision point (after remat's): its body ops up to which the backward
            # gathers the parameters they gather again (0: none), declared by meshdsl.planner.remat
            below = ctx.planner.current + ctx.option(2)
        with param_gather.regathering_below(below):
            return loop.run(ctx, remats.wrap(step, policy), dim, length, x_leaves, x_tree, c_leaves, c_tree,
                            reverse, unroll, where)

    run.relays = sum(map(_is_named, c_leaves))   # the carry enters in its layout placement, relaid by the loop
    run.dim = dim   # what it scans over (a layout splitting it makes a pipeline)
    run.remat = remat   # the planner prices the policies of "auto" (meshdsl.planner.remat)
    run.length = length   # steps: each keeps its carry for the backward pass

    with ctx.at("scan", line), jaxcompat.line_scope(line):  # relayouts of the carry and xs are the scan's own
        carry, ys = ctx.apply("scan", run, (c_leaves, x_leaves), {})
    return (carry if head is None else pipeline_1f1b.head_value(head, carry, where)), ys
