"""Ring attention: context parallelism with keys and values rotating around a mesh axis.

The queries' ``length`` and the keys' ``over`` are both split over ``ring`` (``n`` devices, device
``d`` holding chunk ``d`` of each). Forward: ``n`` steps; at step ``s`` device ``d`` folds key/value
chunk ``d - s`` into its running max and sum (:func:`meshdsl.ops.flash.forward_chunk`), then passes
its chunk to device ``d + 1``: ``n - 1`` rotations of k and v, ``2 (n-1) |K_loc|`` bytes, and no
device ever holds more than its own chunk and the one passing through.

Backward (a hand-written vjp: only q, the local k and v, the output and its log-sum-exp are kept):
the chunks rotate the other way round, the own chunk's gradients last, so the dk/dv accumulators
travel with the chunk they belong to and reach their owner in ``n - 1`` hops: k, v, dk and dv
rotate ``n - 1`` times each,
``4 (n-1) |K_loc|``. The bias and mask are read by the chunk's global columns, the causal mask
from the chunk's global positions, so any order of the sequence (zigzag) is attention over
its positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..rewrite import collectives as C
from ..costmodel import cost
from . import flash
from ..names.dims import Shape
from .attention_bias import named_operands
from .attention_cost import kernel, record
from .attention_local import chunk, dense, operands

__all__ = ["ring_attention"]


def ring_attention(ctx, spec, dims, axes, ring, q, k, v, bias, mask, pos, block):
    """Attention with ``over`` split over ``ring`` like ``length``, by rotating keys and values."""
    keyed = {**axes, spec.over: ()}     # what lies along the keys' positions: whole, read by chunk
    vary = ctx.vary(list(axes.values()) + [ring], [q, k, v] + named_operands(bias, mask))
    (ql, _, _), b, m, qp, kp = operands(ctx, spec, dims, keyed, q, k, v, bias, mask, pos, vary)
    placed = {**axes, spec.over: ring}
    kl, vl = ctx.local(k, placed, vary), ctx.local(v, placed, vary)
    rings = _Ring(ctx, spec, ring, kl.shape[spec.k.index(spec.over)], block)
    scope = record(ctx, spec, dims, "ring", ring, ql, kl, vl, v.dtype, pos, block)
    kv_bytes = sum(cost.array_bytes(x.shape, x.dtype, ctx.mesh.platform) for x in (kl, vl))
    n = rings.n
    ctx.rec.backward_bytes(cost.moved_bytes("collective-permute", kv_bytes, kv_bytes, n) * (n - 1), ring)
    out = C.attributed_vjp(ctx, kernel(scope, "f", rings.forward), kernel(scope, "b", rings.backward))(
        ql, kl, vl, b, m, qp, kp)
    return ctx.out(out, Shape(dims[name] for name in spec.out), axes)


class _Ring:
    """The ring's forward and backward passes (every array an argument: a custom_vjp closing over
    a tracer breaks under remat and scan)."""

    def __init__(self, ctx, spec, ring, size, block):
        self.ctx, self.spec, self.ring, self.size, self.block = ctx, spec, ring, size, block
        self.n = ctx.axes_size(ring)

    def rotate(self, x, what, way=1):
        perm = [(i, (i + way) % self.n) for i in range(self.n)]
        return C.ppermute(self.ctx, x, self.ring, perm, f"{what} of attention (ring step)")

    def chunk(self, kc, vc, owner, b, m, kp):
        """Chunk ``owner``'s keys and values ``kc, vc`` with its columns of the rest."""
        spec, start = self.spec, owner * self.size
        columns = b if spec.bias_fn is not None else _columns(b, spec.bias, spec.over, start, self.size)
        return chunk(spec, kc, vc, columns, _columns(m, spec.mask, spec.over, start, self.size),
                     jax.lax.dynamic_slice_in_dim(kp, start, self.size))

    def forward(self, ql, kl, vl, b, m, qp, kp):
        """Step 0 the own chunk; steps 1 .. n-1 a ``lax.scan`` whose carry holds one chunk."""
        spec, n, me = self.spec, self.n, C.axis_index(self.ring)
        state = flash.forward_chunk(spec, ql, self.chunk(kl, vl, me, b, m, kp), qp,
                                    (*flash.start(spec, ql), None), self.block, self.block)

        def step(carry, i):
            kc, vc, *state = carry
            with self.ctx.rec.loop(n - 1, inside_op=True):
                kc, vc = self.rotate(kc, "keys"), self.rotate(vc, "values")
            state = flash.forward_chunk(spec, ql, self.chunk(kc, vc, (me - i) % n, b, m, kp), qp, tuple(state),
                                        self.block, self.block)
            return (kc, vc, *state), None

        if n > 1:
            (_, _, *state), _ = jax.lax.scan(step, (kl, vl, *state), jnp.arange(1, n))
        out, lse = flash.finish(spec, tuple(state), vl.dtype)
        return out, (ql, kl, vl, b, m, qp, kp, out, lse)

    def backward(self, res, ct):
        """The chunks rotate the other way round (XLA cannot reuse the forward's rotated copies,
        which would hold every chunk until the backward pass: the whole sequence per device),
        the own chunk last: the accumulators of dk and dv travel ``n - 1`` hops. Steps 2 .. n-1
        are a ``lax.scan`` whose carry holds one chunk and its accumulators."""
        ql, kl, vl, b, m, qp, kp, out, lse = res
        spec, n, me = self.spec, self.n, C.axis_index(self.ring)
        dout = dense(ct, out).astype(vl.dtype)
        delta = jnp.einsum(f"{spec.letters(spec.out, spec.out)}->{spec.letters(spec.stats)}",
                           dout.astype(jnp.float32), out.astype(jnp.float32))
        grads = _Grads(self, ql, qp, lse, dout, delta, b, me)
        kc, vc, acc = kl, vl, None
        if n > 1:
            kc, vc = self.rotate(kc, "keys", -1), self.rotate(vc, "values", -1)
            acc = grads.add(None, self.chunk(kc, vc, (me + 1) % n, b, m, kp), 1)

        def step(carry, i):
            kc, vc, acc, dq, db = carry
            with self.ctx.rec.loop(n - 2, inside_op=True):
                kc, vc = self.rotate(kc, "keys", -1), self.rotate(vc, "values", -1)
                acc = tuple(self.rotate(a, f"{w} gradient", -1) for a, w in zip(acc, ("keys", "values")))
            grads.dq, grads.db = dq, db
            acc = grads.add(acc, self.chunk(kc, vc, (me + i) % n, b, m, kp), i)
            return (kc, vc, acc, grads.dq, grads.db), None

        if n > 2:
            (kc, vc, acc, grads.dq, grads.db), _ = jax.lax.scan(step, (kc, vc, acc, grads.dq, grads.db),
                                                               jnp.arange(2, n))
        if acc is not None:   # home: the accumulators of the own chunk, from the previous device
            acc = tuple(self.rotate(a, f"{w} gradient", -1) for a, w in zip(acc, ("keys", "values")))
        dk, dv = grads.add(acc, self.chunk(kl, vl, me, b, m, kp), 0)
        db = None if grads.db is None else jax.tree.map(lambda d, t: d.astype(t.dtype), grads.db, b)
        return (grads.dq.astype(ql.dtype), dk.astype(kl.dtype), dv.astype(vl.dtype), db, None, None, None)


class _Grads:
    """The running gradients of a ring's backward pass: ``dq``, the bias's (or its table's)."""

    def __init__(self, ring, ql, qp, lse, dout, delta, b, me):
        self.ring, self.ql, self.qp, self.lse, self.dout, self.delta, self.me = ring, ql, qp, lse, dout, delta, me
        self.dq = jnp.zeros(ql.shape, jnp.float32)
        self.db = None if b is None else jax.tree.map(lambda t: jnp.zeros(t.shape, jnp.float32), b)

    def add(self, acc, c, step):
        """Chunk ``c`` (``step``'s) into dq and the bias's gradient; its dk, dv added to ``acc``."""
        r, spec = self.ring, self.ring.spec
        dq, dk, dv, db = flash.backward_chunk(spec, self.ql, c, self.qp, self.lse, self.dout, self.delta,
                                              r.block, r.block)
        self.dq = self.dq + dq
        if spec.bias_fn is not None:   # the table's gradient: every tile's, summed
            self.db = jax.tree.map(lambda t, d: t + d.astype(jnp.float32), self.db, db)
        elif self.db is not None:
            self.db = _add_columns(self.db, db, spec.bias, spec.over, ((self.me + step) % r.n) * r.size)
        return (dk, dv) if acc is None else (acc[0] + dk, acc[1] + dv)


def _columns(x, names, over, start, size):
    """The ``size`` columns of ``x`` along ``over`` from ``start`` (all of ``x`` without ``over``)."""
    if x is None or over not in names:
        return x
    return jax.lax.dynamic_slice_in_dim(x, start, size, axis=names.index(over))


def _add_columns(total, part, names, over, start):
    """``total`` with ``part`` added at columns ``start ..`` along ``over``."""
    if over not in names:
        return total + part
    axis = names.index(over)
    now = jax.lax.dynamic_slice_in_dim(total, start, part.shape[axis], axis=axis)
    return jax.lax.dynamic_update_slice_in_dim(total, now + part.astype(total.dtype), start, axis=axis)
