"""A scan over a dim the layout splits is a pipeline over that mesh axis (GPipe).

With ``md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": M})``, an
``md.scan(step, carry, xs, dim="layers")`` inside ``md.lower`` runs as a pipeline of ``S`` stages
(the size of ``pipe``): each device holds its ``layers / S`` layers (its block of ``xs``), the carry
is cut into ``M`` microbatches along ``batch``, and ``T = M + S - 1`` ticks each

1. let stage 0 take the next microbatch,
2. run the stage's layers on the microbatch at hand (an ordinary loop, :mod:`meshdsl.ops.loop`),
3. let the last stage keep its finished microbatch,
4. shift every stage's microbatch one stage on: one ``ppermute`` over ``pipe``
   (:func:`meshdsl.rewrite.collectives.ppermute`), the ``shift`` rule of the rewriter table.

The finished carry lives on the last stage; the others hold zeros, so the result is a *pending*
sum over ``pipe``: the next op that needs whole values reduces it (or reduce-scatters it where the
layout splits it over ``pipe``). Gradients come from autodiff through the tick loop (the reverse
pipeline: each ``ppermute`` transposes to the inverse shift). Bubble ticks compute on zeros that
never reach a finished microbatch, so they add nothing to the gradients.

Values the step captures whole from outside (the encoder output a decoder layer attends to, a
padding mask) are cut to the microbatch at hand: an op reading one sees the rows of the
microbatch its stage processes at this tick (:class:`Microbatch`). Random numbers drawn in the
step use the rows' global positions, so dropout masks equal the unsharded program's.

The step's scan outputs (``ys``) come back stacked along the scanned dim, each stage holding its
own layers' outputs for the whole batch (:mod:`meshdsl.ops.pipeline_ys`); with more than one
microbatch each must keep the microbatch dim (per-example values, reduced after the scan).

The step must treat microbatch rows independently (true of layers over a batch of examples).
Random numbers are placed by their global positions along the microbatch dim only: a draw over a
dim made from it under another name (MoE's token ``group``: router jitter, expert dropout) is the
same for every microbatch, unlike the unsharded program's. Without ``microbatches=`` the pipeline
runs one microbatch (correct, all bubble). ``schedule='1f1b'``: :mod:`meshdsl.ops.pipeline_1f1b`.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..platform import jaxcompat
from ..names.dims import Dim, Shape
from ..names.errors import LayoutError, MeshDSLError
from ..platform.jaxcompat import varying_axes
from ..names.named import NamedArray, Placement, is_named
from . import loop, pipeline_1f1b, pipeline_circular, pipeline_ys

__all__ = ["run", "SCHEDULES"]

SCHEDULES = ("gpipe", "1f1b", "circular")


def run(ctx, step, dim, length, x_leaves, x_tree, c_leaves, c_tree, where, head=None, schedule=None):
    """``(carry, ys)`` of ``md.scan`` over ``dim`` split by the layout (``(head(carry), ys)`` with a
    ``head``): a GPipe pipeline, or 1F1B (:mod:`meshdsl.ops.pipeline_1f1b`); ``schedule`` (this
    scan's) overrides md.lower's."""
    schedule = schedule or ctx.schedule
    axis, stages = _pipe_axis(ctx, dim, length, where)   # the stage axis's factor axes (meshdsl.names.mesh)
    name = ctx.layout.axes(dim)[0]
    others = sorted(d for d, axes in ctx.layout.rules.items() if name in axes and d != dim)
    if others:
        raise LayoutError(f"{where}: the pipeline axis {name!r} splits {dim!r}; the layout also maps "
                          f"{others} to it, which a stage cannot split: map them to other axes")
    if ctx.frame is not None:
        raise LayoutError(f"{where}: a pipeline inside a pipeline; split only the outer scan's dim")
    if schedule not in SCHEDULES:
        raise MeshDSLError(f"{where}: schedule {schedule!r} is not lowered yet; use one of {SCHEDULES}")
    micro, m = _microbatches(ctx, c_leaves, dim, name, where)
    repeats = ctx.repeats if schedule == "circular" else 1
    pipeline_circular.check(ctx, dim, length, stages, repeats, m, where)
    inputs, templates = _cut(ctx, c_leaves, axis, name, micro, m, where)
    carry_axes = frozenset(a for t in templates for axes in t[2].axes for a in axes)
    xs = [_local_stack(ctx, leaf, dim, axis, carry_axes) for leaf in x_leaves]
    line = ctx.op[1] if ctx.op else "?"
    ticks = repeats * m + stages - 1
    entry = {"dim": dim, "axis": name, "stages": stages, "microbatches": m, "schedule": schedule,
             "ticks": ticks, "bubble_fraction": (stages - 1) / ticks, "line": line}
    if schedule == "circular":
        entry["repeats"] = repeats
        with ctx.at("scan", line):
            xs = pipeline_circular.cyclic(ctx, xs, dim, axis, stages, repeats, carry_axes)
    if schedule == "1f1b":
        if head is None:
            raise LayoutError(f"{where}: schedule '1f1b' runs each microbatch's backward pass inside the pipeline, "
                              "so the loss must be computed there: pass md.scan(..., head=loss_fn) (the final "
                              "carry -> the loss summed over its rows), or use schedule='gpipe'")
        rows = templates[0][0]
        frame = lambda index, hoist: Microbatch(rows.names[0], m, rows[rows.names[0]].size, templates[0][2].axes[0],  # noqa: E731
                                                index, axis, hoist)
        ctx.pipelines.append({**entry, "ticks": m + 2 * stages - 2, "in_flight": 2 * stages - 1})
        totals, tree, ys = pipeline_1f1b.run(ctx, step, head, dim, length // stages, xs, x_tree, c_tree, inputs,
                                             templates, axis, stages, m, frame, where, line)
        values = [ctx.out(total, dims, {}, frozenset(pending)) for total, pending, dims in totals]
        return jax.tree_util.tree_unflatten(tree, values), jax.tree_util.tree_unflatten(ys, [])
    ctx.pipelines.append(entry)
    widen = frozenset()
    mark = ctx.checkpoint()
    while True:
        try:
            outs, y_tree = _ticks(ctx, step, dim, length // stages, xs, x_tree, c_tree, inputs, templates,
                                  axis, (stages, repeats, m), widen, where, line)
            break
        except loop.Widen as w:
            widen |= w.axes
            ctx.rollback(mark)
    outs, (ys, y_templates) = outs
    carry = [_join(ctx, o, t, micro, axis) for o, t in zip(outs, templates)]
    ys = pipeline_ys.assemble(ctx, ys, y_templates, m, C.axis_index(axis), axis)
    carry = jax.tree_util.tree_unflatten(c_tree, carry)
    if head is not None:
        carry = pipeline_1f1b.head_value(head, carry, where)
    return carry, jax.tree_util.tree_unflatten(y_tree, ys)


def _pipe_axis(ctx, dim, length, where):
    """The factor axes of the one mesh axis the layout splits ``dim`` over, and its size."""
    written = tuple(a for a in ctx.layout.axes(dim) if ctx.axes_size((a,)) > 1)
    if len(written) != 1:
        raise LayoutError(f"{where}: the layout splits {dim!r} over {'+'.join(written)}; a pipeline runs over one "
                          f"mesh axis: map {dim!r} to a single axis (e.g. '{dim}': 'pipe')")
    stages = ctx.axes_size(written)
    if length % stages:
        raise LayoutError(f"{where}: {dim}:{length} cannot be cut into {stages} pipeline stages "
                          f"({written[0]} has size {stages}); use a multiple of {stages} layers or a smaller axis")
    return ctx.layout_axes(dim), stages


def _microbatches(ctx, c_leaves, dim, name, where):
    micro = dict(ctx.layout.microbatches)
    if not micro:
        names = [leaf.names for leaf in c_leaves if is_named(leaf)]
        if names and all("batch" in ns for ns in names):
            return "batch", 1
        raise LayoutError(f"{where}: the layout splits {dim!r} over {name!r}: a pipeline, which cuts its carry "
                          "into microbatches; name the dim to cut with md.Layout(..., microbatches={'batch': M}), "
                          f"or remove the rule for {dim!r}")
    ((name, m),) = micro.items()
    return name, m


def _cut(ctx, c_leaves, axis, name, micro, m, where):
    """Each carry leaf's local block as ``[M, rows per microbatch, ...]`` (the microbatch dim
    first), and templates (dims and placement of one microbatch) to rebuild NamedArrays."""
    inputs, templates = [], []
    for i, leaf in enumerate(c_leaves):
        if not is_named(leaf) or micro not in leaf.names:
            got = f"[{leaf.dims}]" if is_named(leaf) else type(leaf).__name__
            raise LayoutError(f"{where}: a pipeline cuts its carry into microbatches along {micro!r}; carry "
                              f"entry {i} {got} has no such dim")
        axes = ctx.canonical(leaf.dims)
        if any(set(axis) & set(a) for a in axes):
            raise LayoutError(f"{where}: carry entry {i} [{leaf.dims}] is split over the pipeline axis "
                              f"{name!r}; the layout may not map its dims to {name!r}")
        arr = ctx.local(leaf, dict(zip(leaf.names, axes)), frozenset(a for ax in axes for a in ax))
        pos = leaf.names.index(micro)
        rows = arr.shape[pos]
        if rows % m:
            raise LayoutError(
                f"{where}: {micro}:{leaf.dims[micro].size} leaves {rows} rows per device, which "
                f"{m} microbatches cannot divide; choose microbatches={{'{micro}': k}} with k dividing {rows}")
        arr = jnp.moveaxis(arr, pos, 0)
        inputs.append(arr.reshape((m, rows // m) + arr.shape[1:]))
        first = [pos] + [k for k in range(len(axes)) if k != pos]   # the microbatch dim first
        dims = Shape(Dim(micro, leaf.dims[k].size // m) if k == pos else leaf.dims[k] for k in first)
        templates.append((dims, leaf.is_param, Placement(tuple(axes[k] for k in first)), leaf.dims, axes, pos))
    return inputs, templates


def _local_stack(ctx, leaf, dim, axis, carry_axes):
    """This stage's layers of a stacked ``xs`` leaf, as a NamedArray whose ``dim`` is whole.

    A parameter stored split (ZeRO-3) under ``param_gather="keep"`` is gathered here, once per
    step, to the layout's placement (its gradient reduce-scattered once, after the ticks); under
    ``"regather"`` and ``"auto"`` it stays as stored and each tick gathers what it reads (per
    microbatch: less memory, more bytes). The gathered copy is typed like the carry (the data
    axes), so its gradient leaves the ticks as partial sums: one reduce-scatter, not an all-reduce."""
    pl = ctx.placement(leaf)
    held, extra = pl.axes, frozenset()
    if leaf.is_param and ctx.params.name == "keep" and not pl.pending:
        held = tuple(ctx.layout_axes(d.name) if d.name != dim else a for d, a in zip(leaf.dims, pl.axes))
        if held != pl.axes:
            extra = carry_axes
    axes = {d.name: a for d, a in zip(leaf.dims, held)}
    axes[dim] = axis
    vary = ctx.vary(axes.values(), [leaf], pl.pending) | extra
    arr = ctx.local(leaf, axes, vary, keep_pending=pl.pending)
    n = arr.shape[leaf.names.index(dim)]
    dims = Shape(Dim(dim, n) if d.name == dim else d for d in leaf.dims)
    inner = Placement(tuple(() if d.name == dim else a for d, a in zip(leaf.dims, held)), pl.pending)
    return NamedArray(arr, dims, is_param=leaf.is_param, placement=inner)


class Microbatch:
    """The microbatch a stage processes during one tick: ``index`` (traced) of ``count``
    microbatches of ``size`` rows (global) along ``dim``, split over ``axes`` like the carry."""

    def __init__(self, dim, count, size, axes, index, stage_axis, hoist=frozenset()):
        self.dim, self.count, self.size, self.axes, self.index = dim, count, size, axes, index
        self.stage_axis = frozenset(stage_axis)   # its factor axes: values legitimately differ between stages
        self.trace = jaxcompat.current_trace()   # the tick's: cuts are made there, once per tick
        self.hoist = hoist   # 1F1B: values read from outside vary over these, cast where they are made
        self._cut: dict = {}
        self._rows = {(dim, size)}   # (name, size) of dims cut like the microbatch (its renames, MoE's groups)

    def take(self, ctx, x: NamedArray) -> NamedArray:
        """``x`` as an op inside the step sees it: a pending sum over the stage axis reduced (each
        stage holds other layers: partial sums of a value made outside must not meet them), and
        this microbatch's rows of a value with the whole batch's ``dim``; once per value and tick."""
        pl = ctx.placement(x)
        if self.stage_axis & pl.pending:
            keep = pl.pending - self.stage_axis
            axes = dict(zip(x.names, pl.axes))
            local = ctx.local(x, axes, ctx.vary(axes.values(), [x], keep), keep_pending=keep)
            x = NamedArray(local, x.dims, is_param=x.is_param, placement=Placement(pl.axes, keep))
        if self.dim not in x.names or x.dims[self.dim].size != self.size * self.count or self.count == 1:
            return self._hoisted(ctx, x)
        hit = self._cut.get(id(x.raw))
        if hit is None:
            pl = ctx.placement(x)
            target = {d.name: a for d, a in zip(x.dims, pl.axes)}
            target[self.dim] = self.axes
            vary = ctx.vary(target.values(), [x], pl.pending) | self.stage_axis | self.hoist   # cast once, outside
            local = ctx.local(x, target, vary, keep_pending=pl.pending)
            pos = x.names.index(self.dim)
            rows = local.shape[pos] // self.count
            with jaxcompat.in_trace(self.trace):
                part = jax.lax.dynamic_slice_in_dim(local, self.index * rows, rows, axis=pos)
            dims = Shape(Dim(self.dim, self.size) if d.name == self.dim else d for d in x.dims)
            placement = Placement(tuple(target[d.name] for d in x.dims), pl.pending)
            hit = self._cut[id(x.raw)] = (x, NamedArray(part, dims, is_param=x.is_param, placement=placement))
        return hit[1]

    def _hoisted(self, ctx, x: NamedArray) -> NamedArray:
        """``x``, made outside the step, cast to vary over ``hoist`` in the trace that made it (so
        its gradient is summed once there, not in every tick)."""
        trace = jaxcompat.current_trace()
        pl = ctx.placement(x)
        need = self.hoist - varying_axes(x.raw)
        if not (need or pl.pending) or not jnp.issubdtype(x.dtype, jnp.inexact) or \
                jaxcompat.enclosing_trace(x.raw, trace) is trace:
            return x
        hit = self._cut.get(id(x.raw))
        if hit is None:   # a pending sum is reduced there too (a reduction traced inside the stage is not)
            with jaxcompat.in_trace(jaxcompat.enclosing_trace(x.raw, trace)):
                arr = ctx.local(x, dict(zip(x.names, pl.axes)), ctx.vary(pl.axes, [x], frozenset()))
                arr = C.cast(ctx, arr, loop.order(ctx, self.hoist - varying_axes(arr)))
            hit = self._cut[id(x.raw)] = (x, NamedArray(arr, x.dims, is_param=x.is_param, placement=Placement(pl.axes)))
        return hit[1]

    def block_start(self, name: str, size: int, split, block: int):
        """Global row of this device's first row of the microbatch along ``dim`` (or a dim cut
        like it: :meth:`same_rows`): microbatches are cut from each device's block of the batch,
        so device ``d`` of ``split`` holds global rows ``d * block * count + index * block + r``.
        Placed otherwise than the carry, the global rows of the block's entries (an array)."""
        d = C.axis_index(split) if split else 0
        if (name, size) not in self._rows or self.count == 1:
            return d * block if split else 0
        if tuple(split) == tuple(self.axes):
            return d * block * self.count + self.index * block
        # placed otherwise than the carry (a dim it was merged into, gathered): the block's
        # positions p in the microbatch are not contiguous in the batch; each device of the
        # carry's axes holds `own` of them, cut from its block of the whole batch
        own = size // math.prod(jax.lax.axis_size(a) for a in self.axes)
        p = jnp.arange(block, dtype=jnp.int32) + (d * block if split else 0)
        return (p // own) * own * self.count + self.index * own + p % own

    def extent(self, name: str, size: int) -> int:
        """Rows of the whole batch along ``dim`` (other dims: their own size)."""
        return size * self.count if (name, size) in self._rows else size

    def same_rows(self, old, new) -> None:
        """Dim ``new`` (a Dim) is cut from each device's block like ``old``: a rename of the
        microbatch dim, or the leading dim a reshape merges it into (``[batch, seq] -> [group]``)."""
        if (old.name, old.size) in self._rows:
            self._rows.add((new.name, new.size))


def _ticks(ctx, step, dim, per_stage, xs, x_tree, c_tree, inputs, templates, axis, sizes, widen, where, line):
    """Run the ``R M + S - 1`` ticks (``sizes``: ``(S, R, M)``; GPipe: ``R = 1``); returns each
    carry leaf's ``[M, ...]`` finished microbatches (zeros except on the last stage) with the ``ys``
    leaves of every tick ``[ticks, ...]`` and their templates (:mod:`meshdsl.ops.pipeline_ys`),
    and the structure of the step's ``ys``. With ``R > 1`` (circular) a tick runs the stage's
    chunk of the item's repeat, and the last stage hands items back to the first."""
    stages, repeats, m = sizes
    items, ring = repeats * m, repeats > 1
    stage = C.axis_index(axis)
    vary = [frozenset(a for ax in t[2].axes for a in ax) | set(axis) | widen for t in templates]
    bufs = [C.cast(ctx, jnp.zeros(i.shape[1:], i.dtype), loop.order(ctx, v)) for i, v in zip(inputs, vary)]
    outs = [C.cast(ctx, jnp.zeros_like(i), loop.order(ctx, v)) for i, v in zip(inputs, vary)]
    waiting = [C.cast(ctx, jnp.zeros_like(i), loop.order(ctx, v)) for i, v in zip(inputs, vary)] if ring else []
    inputs = [C.cast(ctx, i, loop.order(ctx, varying_axes(i) | set(axis))) for i in inputs]
    shift = [(s, s + 1) for s in range(stages - 1)] + ([(stages - 1, 0)] if ring and stages > 1 else [])
    y_tree, y_templates = [], []
    at = lambda a, k: jax.lax.dynamic_index_in_dim(a, k, 0, keepdims=False)  # noqa: E731

    def tick(state, t):
        bufs, outs, waiting = state
        k = jnp.clip(t - stage, 0, items - 1)       # the item at hand: repeat k // M of microbatch k % M
        i = k % m
        fresh = pipeline_circular.entering([at(x, i) for x in inputs], waiting, k, i, m)
        bufs = [jnp.where((stage == 0) & (t < items), f, b) for f, b in zip(fresh, bufs)]
        carry = [NamedArray(b, t_[0], is_param=t_[1], placement=t_[2]) for b, t_ in zip(bufs, templates)]
        rows = templates[0][0]
        micro_dim = rows.names[0]
        ctx.frame = Microbatch(micro_dim, m, rows[micro_dim].size, templates[0][2].axes[0], i.astype(jnp.int32),
                               axis)
        try:
            carry, ys = _stage(ctx, step, dim, per_stage, repeats, xs, x_tree, carry, c_tree, k // m, where)
        finally:
            ctx.frame = None
        y_tree.append(jax.tree_util.tree_structure(ys, is_leaf=is_named))
        y_arrays, y_templates[:] = pipeline_ys.per_tick(ctx, ys, micro_dim, templates[0][2].axes[0], m, axis, where)
        if ring and y_arrays:
            raise LayoutError(f"{where}: the circular schedule does not return scan outputs (ys) yet; carry "
                              "per-example sums in the carry or compute them in md.scan's head, or use "
                              "schedule='gpipe'")
        new = [ctx.local(c, dict(zip(c.names, t_[2].axes)), v) for c, t_, v in
               zip(jax.tree_util.tree_leaves(carry, is_leaf=is_named), templates, vary)]
        for n, (a, v) in enumerate(zip(new, vary)):
            if varying_axes(a) - v:
                raise loop.Widen(n, varying_axes(a) - v)
        done = t - (stages - 1) - (items - m)     # the last repeat's microbatch the last stage finished
        keep = (stage == stages - 1) & (done >= 0)
        slot = jnp.clip(done, 0, m - 1)
        outs = [jax.lax.dynamic_update_index_in_dim(o, jnp.where(keep, a, at(o, slot)), slot, 0)
                for o, a in zip(outs, new)]
        if shift:
            with ctx.at("scan", line):
                new = [C.ppermute(ctx, a, axis, shift, f"[{t_[0]}] microbatch to the next stage")
                       for a, t_ in zip(new, templates)]
        waiting = pipeline_circular.wait(waiting, new, stage, t - (stages - 1), items, m)
        return (new, outs, waiting), y_arrays

    with ctx.rec.loop(items + stages - 1):
        (_, outs, _), ys = jax.lax.scan(tick, (bufs, outs, waiting), jnp.arange(items + stages - 1))
    return (outs, (ys, y_templates)), y_tree[-1]


def _stage(ctx, step, dim, per_stage, repeats, xs, x_tree, carry, c_tree, repeat, where):
    """The stage's layers on the carry at hand: all of them (GPipe), or the chunk of ``repeat``
    (circular), cut inside a ``jax.checkpoint`` that keeps only einsum results and collectives'
    results for the backward pass: the chunk and what is made from it (the weights, one chunk per
    tick) are cut again from the stack there, and no collective runs twice."""
    if repeats == 1:
        return loop.run(ctx, step, dim, per_stage, xs, x_tree, carry, c_tree, False, 1, where)

    def run(carry, stacks, repeat):
        return loop.run(ctx, step, dim, per_stage // repeats, _chunk(stacks, dim, repeat, repeats), x_tree, carry,
                        c_tree, False, 1, where)
    policy = jax.checkpoint_policies.save_only_these_names("einsum", *C.KINDS)
    return jax.checkpoint(run, policy=policy)(carry, xs, repeat)


def _chunk(xs, dim, repeat, repeats):
    """The stage's chunk of layers for ``repeat`` (traced) of its ``repeats`` chunks."""
    out = []
    for x in xs:
        size = x.dims[dim].size // repeats
        part = jax.lax.dynamic_slice_in_dim(x.raw, repeat * size, size, axis=x.names.index(dim))
        dims = Shape(Dim(dim, size) if d.name == dim else d for d in x.dims)
        out.append(NamedArray(part, dims, is_param=x.is_param, placement=x.placement))
    return out


def _join(ctx, out, template, micro, axis):
    """``[M, rows, ...]`` back to the carry's local block, its sum over the pipeline axis reduced
    where it leaves the pipeline: only the last stage holds it, and its readers (a norm, a decoder
    attending to it in every layer, through linear ops that would carry the sum on to each of
    them) need it whole, so it is reduced once, here."""
    _, is_param, _, dims, axes, pos = template
    arr = jnp.moveaxis(out.reshape((out.shape[0] * out.shape[1],) + out.shape[2:]), 0, pos)
    pending = ctx.out(arr, dims, dict(zip(dims.names, axes)), frozenset(axis), is_param=is_param)
    whole = ctx.local(pending, dict(zip(dims.names, axes)))
    return NamedArray(whole, dims, is_param=is_param, placement=Placement(tuple(axes)))
