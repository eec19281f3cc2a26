"""The 1F1B pipeline schedule: one forward, one backward, at most ``2S - 1`` microbatches in flight.

``md.lower(..., schedule="1f1b")`` with an ``md.scan(step, carry, xs, dim="layers", head=loss)``
over a dim the layout splits (``layers: pipe``): the pipeline computes ``loss(carry)`` of each
finished microbatch on the last stage and returns their sum (``head`` must be a sum over the
microbatch rows, such as a summed token loss). Under ``jax.grad`` the gradients of that sum are
computed by the same tick loop that runs the forward pass, so a stage starts a microbatch's
backward pass as soon as its cotangent arrives instead of after every forward pass:

* tick ``t`` of ``T = M + 2S - 2``, stage ``s``: a forward phase (stages ``0 .. S-2``) runs the stage's
  layers on microbatch ``t - s`` and keeps its input; a backward phase runs the vector-Jacobian
  product of the stage (the last stage: the stage and ``head``) on microbatch ``t - (2S - 2 - s)``,
  from the kept input (recomputing the stage's forward pass) and the cotangent from the next stage;
* then two ``ppermute`` over the pipeline axis: activations one stage on, cotangents one stage back;
  ticks with nothing to send to a later tick send nothing, ``M + S - 2`` shifts each way in all.

Each phase is a ``lax.cond``: a stage with nothing to do computes nothing, so the bubble is GPipe's
``(S - 1) / (M + S - 1)`` of the time, and a stage keeps at most ``2S - 1`` microbatch inputs
(GPipe keeps every tick's activations: ``M + S - 1`` microbatches' worth). The price is one
recomputed forward pass of the stage per microbatch, as with ``remat``.

Mechanics: the step (and head) are traced once into a closed function of (stage weights,
microbatch input, microbatch index) with every value they read from outside hoisted as an explicit
argument (``jax.closure_convert``); a ``jax.custom_vjp`` over (weights, inputs, captured values)
has this module's joint tick loop as its forward rule (value and gradients at once) and scales the
gradients by the loss's cotangent in its backward rule. Without ``jax.grad`` the primal runs a
forward-only loop of ``M + S - 1`` ticks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..rewrite import collectives as C
from ..names.errors import LayoutError
from ..platform.jaxcompat import varying_axes
from ..names.named import NamedArray, is_named
from . import loop
from .elementwise import stop_gradient

__all__ = ["run", "head_value"]


def run(ctx, step, head, dim, per_stage, xs, x_tree, c_tree, inputs, templates, axis, stages, m, frame, where,
        line):
    """``([(total, pending)], tree, ys_tree)``: each head value's sum over the finished
    microbatches, a local scalar (non-zero on the last stage), and the mesh axes it is a pending sum
    over; the structure of the head's values and of the step's (empty) scan outputs. ``inputs``: each carry leaf's
    ``[M, rows, ...]``; ``frame(index, hoist)``: the :class:`~meshdsl.ops.pipeline.Microbatch` of a
    traced microbatch index, casting what the step reads from outside to vary over ``hoist``."""
    widen = frozenset()
    mark = ctx.checkpoint()
    while True:
        try:
            p = _Pipeline(ctx, axis, stages, m, line, inputs, widen)
            x_arrays, ins = [p.cast(x.raw) for x in xs], [p.cast(a) for a in inputs]
            p.trace(step, head, dim, per_stage, xs, x_arrays, x_tree, ins, c_tree, templates, frame, where)
            break
        except loop.Widen as w:   # the step makes the carry vary over more axes: trace again, wider
            widen |= w.axes
            ctx.rollback(mark)

    @jax.custom_vjp
    def pipelined(ws, ins, cs):
        return p.forward_only(ws, ins, cs)

    def bwd(grads, g):   # g: the cotangents of the loss and of the aux values (not differentiated)
        scale = lambda a: a if a.dtype == jax.dtypes.float0 else a * g[0].astype(a.dtype)  # noqa: E731
        g_ws, g_ins, g_cs = (tuple(scale(a) for a in part) for part in grads)
        # a captured value the stage read without a cast (plain jax code on it): the implicit cast's
        # transpose, a sum over the axes its cotangent varies over and it does not, once per step
        g_cs = [g if g.dtype == jax.dtypes.float0 else C.psum(ctx, g, loop.order(ctx, varying_axes(g) - varying_axes(c)))
                for g, c in zip(g_cs, p.consts)]
        return list(g_ws), list(g_ins), g_cs

    pipelined.defvjp(p.joint, bwd)
    totals = pipelined(x_arrays, ins, p.consts)
    return ([(t, pending | set(axis), dims) for t, pending, dims in zip(totals, p.seen["pending"], p.seen["dims"])],
            p.seen["tree"], p.seen["ys"])


class _Pipeline:
    """One 1F1B pipeline: the stage function traced once, and its tick loops."""

    def __init__(self, ctx, axis, stages, m, line, inputs, widen):
        self.ctx, self.axis, self.stages, self.m, self.line = ctx, axis, stages, m, line
        self.stage = C.axis_index(axis)
        # the carry's type (its splits and the stage axis); weights and captured values are cast to
        # it once, before the ticks, so their gradients are summed over those axes once per step
        self.vary = frozenset().union(*(varying_axes(a) for a in inputs)) | set(axis) | widen
        self.seen: dict = {}

    def cast(self, a):
        return C.cast(self.ctx, a, loop.order(self.ctx, self.vary - varying_axes(a)))

    def zeros(self, a):
        return C.cast(self.ctx, jnp.zeros(a.shape, a.dtype), loop.order(self.ctx, varying_axes(a)))

    def scalar(self):
        """Zeros for the head's values (the loss and the aux values)."""
        return [self.cast(jnp.zeros(dims.sizes, dtype)) for dims, dtype in zip(self.seen["dims"], self.seen["dtype"])]

    def trace(self, step, head, dim, per_stage, xs, x_arrays, x_tree, ins, c_tree, templates, frame, where):
        """Trace the stage (its layers, and the head on the last stage) once into ``self.converted``
        of (weights, microbatch input, microbatch index, *captured values); ``self.consts``."""
        ctx, vary, stages = self.ctx, self.vary, self.stages
        x_templates = [(x.dims, x.is_param, x.placement) for x in xs]

        def stage_fn(ws, x_in, index):
            ctx.frame = frame(index, vary)
            try:
                weights = [NamedArray(a, t[0], is_param=t[1], placement=t[2]) for a, t in zip(ws, x_templates)]
                carry = [NamedArray(b, t[0], is_param=t[1], placement=t[2]) for b, t in zip(x_in, templates)]
                carry, ys = loop.run(ctx, step, dim, per_stage, weights, x_tree, carry, c_tree, False, 1, where)
                self.seen["ys"] = jax.tree_util.tree_structure(ys, is_leaf=is_named)
                if jax.tree_util.tree_leaves(ys):
                    raise LayoutError(f"{where}: schedule '1f1b' runs a step that returns no scan outputs (ys); "
                                      "return None from the step, or use schedule='gpipe'")
                leaves = jax.tree_util.tree_leaves(carry, is_leaf=is_named)
                out = [ctx.local(c, dict(zip(c.names, t[2].axes)), vary) for c, t in zip(leaves, templates)]
                for k, a in enumerate(out):
                    if varying_axes(a) - vary:
                        raise loop.Widen(k, varying_axes(a) - vary)
                loss = jax.lax.switch(jnp.where(self.stage == stages - 1, 0, 1).astype(jnp.int32),
                                      [lambda: self._head(head, carry, where), self.scalar])
            finally:
                ctx.frame = None
            return out, loss

        # replayed with arguments of exactly these types (the microbatch index differs by stage)
        index = C.cast(ctx, jnp.int32(0), self.axis)
        self.converted, self.consts = jax.closure_convert(stage_fn, x_arrays, [a[0] for a in ins], index)
        self.diff = [jnp.issubdtype(c.dtype, jnp.inexact) for c in self.consts]
        self.wdiff = [jnp.issubdtype(w.dtype, jnp.inexact) for w in x_arrays]   # layer numbers ride along too

    def _head(self, head, carry, where):
        """The head's value on the finished microbatch, local with its pending sums kept: what the
        last stage adds to the total."""
        leaves, self.seen["tree"] = jax.tree_util.tree_flatten(head_value(head, carry, where), is_leaf=is_named)
        out, self.seen["pending"], self.seen["dtype"], self.seen["dims"] = [], [], [], []
        micro = self.ctx.frame.dim
        for value in leaves:
            if micro in value.names:
                raise LayoutError(f"{where}: md.scan's head returned [{value.dims}], with the microbatch dim "
                                  f"{micro!r}: the head's values are summed over the microbatches; sum over "
                                  f"{micro!r} in the head")
            self.seen["dims"].append(value.dims)
            pl = self.ctx.placement(value)
            arr = self.ctx.local(value, {}, varying_axes(value.raw) | pl.pending, keep_pending=pl.pending)
            self.seen["pending"].append(pl.pending)
            self.seen["dtype"].append(arr.dtype)
            out.append(self.cast(arr))
        return out

    def send(self, arrays, back: bool):
        if self.stages == 1:
            return arrays
        perm = [(s + 1, s) if back else (s, s + 1) for s in range(self.stages - 1)]
        what = "cotangent to the previous stage" if back else "microbatch to the next stage"
        with self.ctx.at("scan", self.line):
            return [C.ppermute(self.ctx, a, self.axis, perm, what) for a in arrays]

    def _loop(self, tick, state, phases):
        """Run ``tick(state, t, *flags)`` over each phase ``(start, stop, *flags)``: one scan each."""
        for start, stop, *flags in phases:
            if stop > start:
                with self.ctx.rec.loop(stop - start):
                    state, _ = jax.lax.scan(lambda c, t, f=tuple(flags): (tick(c, t, *f), None), state,
                                            jnp.arange(start, stop))
        return state

    def forward_only(self, ws, ins, cs):
        """The loss without gradients: GPipe's ``M + S - 1`` forward ticks; the last sends nothing."""
        stage, m = self.stage, self.m

        def tick(state, t, sends):
            recv, total = state
            idx = jnp.clip(t - stage, 0, m - 1)
            x_in = [jnp.where(stage == 0, a, r) for a, r in zip(_pick(ins, idx), recv)]
            on = (t - stage >= 0) & (t - stage < m)
            out, loss = jax.lax.cond(on, lambda: self.converted(ws, x_in, idx, *cs),
                                     lambda: ([self.zeros(a) for a in x_in], self.scalar()))
            return self.send(out, False) if sends else recv, [a + b for a, b in zip(total, loss)]

        end = m + self.stages - 1
        return self._loop(tick, ([self.zeros(i[0]) for i in ins], self.scalar()),
                          ((0, end - 1, True), (end - 1, end, False)))[1]

    def stage_vjp(self, ws, x_in, g_out, g_loss, idx, cs):
        """Gradients of the float weights, the input and the float captured values, and the loss."""
        def f(dws, x_, dcs):
            return self.converted(_merge(ws, self.wdiff, dws), x_, idx, *_merge(cs, self.diff, dcs))
        def split(*a):   # the loss is differentiated, the aux values are not
            out, values = f(*a)
            return (out, values[0]), values[1:]
        (_, loss), back, aux = jax.vjp(split, _only(ws, self.wdiff), x_in, _only(cs, self.diff), has_aux=True)
        return (*back((g_out, g_loss)), [loss, *aux])

    def joint(self, ws, ins, cs):
        """Value and gradients: ``M + 2S - 2`` ticks in phases (forward only while the first
        microbatch travels to the last stage, then both, then backward only). Forward phases run on
        ticks ``0 .. M+S-3`` (stage S-2's last), backward ones on ``S-1 .. M+2S-3``, and the last
        backward phase (stage 0's) sends nothing: ``M + S - 2`` shifts each way."""
        m, s = self.m, self.stages
        k = 2 * s - 1   # most microbatch inputs a stage keeps (stage 0: from its forward to its backward)
        first = [self.zeros(i[0]) for i in ins]
        state = (first, list(first), [self.cast(jnp.zeros((k,) + i.shape[1:], i.dtype)) for i in ins],
                 [self.zeros(w) for w in _only(ws, self.wdiff)], [self.zeros(c) for c in _only(cs, self.diff)],
                 [self.zeros(i) for i in ins], self.scalar())
        phases = ((0, s - 1, True, False, False), (s - 1, m + s - 2, True, True, True),
                  (m + s - 2, m + 2 * s - 3, False, True, True), (m + 2 * s - 3, m + 2 * s - 2, False, True, False))
        tick = lambda state, t, *flags: self._tick(ws, ins, cs, k, state, t, *flags)  # noqa: E731
        _, _, _, g_ws, g_cs, g_ins, total = self._loop(tick, state, phases)
        return total, (_expand(ws, self.wdiff, g_ws), g_ins, _expand(cs, self.diff, g_cs))

    def _tick(self, ws, ins, cs, k, state, t, do_f, do_b, send_b):
        recv_f, recv_b, slots, acc_ws, acc_cs, g_ins, total = state
        stage, m, last = self.stage, self.m, self.stage == self.stages - 1
        mf, mb = t - stage, t - (2 * self.stages - 2 - stage)
        fi, bi = jnp.clip(mf, 0, m - 1), jnp.clip(mb, 0, m - 1)
        if do_f:
            f_on = (stage < self.stages - 1) & (mf >= 0) & (mf < m)
            x_f = [jnp.where(stage == 0, a, r) for a, r in zip(_pick(ins, fi), recv_f)]
            out = jax.lax.cond(f_on, lambda: self.converted(ws, x_f, fi, *cs)[0],
                               lambda: [self.zeros(a) for a in x_f])
            slots = [jnp.where(f_on, jax.lax.dynamic_update_index_in_dim(sl, x, fi % k, 0), sl)
                     for sl, x in zip(slots, x_f)]
        if do_b:
            b_on = (mb >= 0) & (mb < m)
            x_b = [jnp.where(last, jnp.where(stage == 0, a, r), sl)
                   for a, r, sl in zip(_pick(ins, bi), recv_f, _pick(slots, bi % k))]
            g_out = [jnp.where(last, self.zeros(g), g) for g in recv_b]
            g_loss = self.cast(jnp.where(last, 1, 0).astype(self.seen["dtype"][0]))
            nothing = lambda: ([self.zeros(w) for w in _only(ws, self.wdiff)],  # noqa: E731
                               [self.zeros(a) for a in x_b], [self.zeros(c) for c in _only(cs, self.diff)],
                               self.scalar())
            g_ws, g_x, g_cs, loss = jax.lax.cond(b_on, lambda: self.stage_vjp(ws, x_b, g_out, g_loss, bi, cs),
                                                 nothing)
            g_ins = [jnp.where(b_on & (stage == 0), jax.lax.dynamic_update_index_in_dim(a, g, bi, 0), a)
                     for a, g in zip(g_ins, g_x)]
            acc_ws, acc_cs = [a + g for a, g in zip(acc_ws, g_ws)], [a + g for a, g in zip(acc_cs, g_cs)]
            total = [a + b for a, b in zip(total, loss)]
            if send_b:
                recv_b = self.send(g_x, True)
        if do_f:
            recv_f = self.send(out, False)
        return recv_f, recv_b, slots, acc_ws, acc_cs, g_ins, total


def _pick(arrays, i):
    return [jax.lax.dynamic_index_in_dim(a, i, 0, keepdims=False) for a in arrays]


def _only(arrays, mask):
    return [a for a, keep in zip(arrays, mask) if keep]


def _merge(arrays, mask, part):
    """``arrays`` with the entries ``mask`` selects taken from ``part``."""
    it = iter(part)
    return [next(it) if keep else a for a, keep in zip(arrays, mask)]


def _expand(arrays, mask, grads):
    """Gradients for every entry of ``arrays``: ``grads`` where ``mask``, else float0 zeros."""
    return _merge([np.zeros(a.shape, jax.dtypes.float0) for a in arrays], mask, grads)


def head_value(head, carry, where):
    """``head(carry)``: a loss, or ``(loss, aux)`` with ``aux`` a pytree of values that are not
    differentiated (metrics). The loss is a NamedArray with no dims, a sum over the rows of the
    carry; aux values are NamedArrays summed over the rows (any other dims: an expert load)."""
    value = head(carry)
    loss, aux = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
    for k, v in enumerate([loss] + jax.tree_util.tree_leaves(aux, is_leaf=is_named)):
        if not is_named(v) or (k == 0 and v.dims.names):
            got = f"[{v.dims}]" if is_named(v) else type(v).__name__
            raise LayoutError(f"{where}: md.scan's head must return a NamedArray with no dims (a loss summed over "
                              f"the rows of the carry), or (loss, aux) with aux made of NamedArrays (sums over the "
                              f"rows: no microbatch dim); got {got}")
    if aux is None:
        return loss
    return loss, jax.tree_util.tree_map(stop_gradient, aux, is_leaf=is_named)
