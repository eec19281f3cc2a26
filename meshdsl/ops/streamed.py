"""A scan over stacks kept in host memory (offloaded parameters), each step's slice fetched one step ahead.

Step ``j`` computes with the slices fetched during step ``j - 1`` and starts the transfer of step
``j + 1``'s, which nothing in step ``j`` waits on: the host link works while the step computes,
where a transfer at the top of the step it feeds would hold that step up. The loop is uniform, so
its last step fetches a slice no step uses (the first again): one slice per stack and pass beyond
the stack itself, which explain counts with the rest.

Under ``jax.grad`` a ``jax.custom_vjp`` over the loop keeps, per step, the residuals the step's
own derivative keeps (its remat policy decides) except those computed from the fetched slices and
the values read from outside the loop alone: the backward loop makes those again from the slice
it fetches, so the stack is never held on the device. The backward loop runs the steps in reverse,
fetching one step ahead again, and sends each slice's gradient back to host memory.

The step is traced once (``jax.closure_convert``); both loops replay it, and no rule runs after
the trace.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..platform import jaxcompat
from ..platform.jaxcompat import host_resident, to_memory

__all__ = ["scan"]


def scan(body, carry, xs, reverse, unroll):
    """``(carry, ys)`` of ``lax.scan(body, carry, xs, reverse=reverse)``, where ``body(carry, xs)``
    takes and returns lists of local arrays and some ``xs`` are stacks in host memory."""
    host = [host_resident(x) for x in xs]
    n = int(xs[0].shape[0])
    ahead = -1 if reverse else 1
    stacks = [x for x, h in zip(xs, host) if h]
    first = [jax.lax.stop_gradient(w) for w in _fetch(stacks, n - 1 if reverse else 0)]
    example = _merge(host, first, [x[0] for x, h in zip(xs, host) if not h])
    fn, consts = jax.closure_convert(body, carry, example)
    step = _Step(fn, carry, example, consts)

    def loop(c, w0, hs, ds, cs, keep):
        def one(state, j):
            c, w = state
            out, ys, saved = step.forward(c, _merge(host, w, _pick(ds, j)), cs, keep)
            return (out, _fetch(hs, (j + ahead) % n)), (ys, saved)
        (c, _), (ys, saved) = jax.lax.scan(one, (c, w0), jnp.arange(n), reverse=reverse, unroll=unroll)
        return c, ys, saved

    @jax.custom_vjp
    def streamed(c, w0, hs, ds, cs):
        c, ys, _ = loop(c, w0, hs, ds, cs, False)
        return c, ys

    def fwd(c, w0, hs, ds, cs):
        c_out, ys, saved = loop(c, w0, hs, ds, cs, True)
        return (c_out, ys), (saved, c, w0, hs, ds, cs)

    def bwd(res, cts):
        saved, c, w0, hs, ds, cs = res
        g_c, g_ys = (_only(part) for part in cts)

        def one(state, inp):
            g_c, w, acc = state
            j, saved_j, g_y = inp
            x = _merge(host, w, _pick(ds, j))
            g_c, g_x, g_cs = step.backward(saved_j, x, cs, g_c, g_y)
            g_x = _put([None] * len(x), g_x, x)
            g_w = [to_memory(g, "host") for g, h in zip(g_x, host) if h]
            g_d = [g for g, h in zip(g_x, host) if not h and g is not None]
            nxt = _fetch(hs, (j - ahead) % n)
            return (g_c, nxt, [a + g for a, g in zip(acc, g_cs)]), (g_w, g_d)

        start = _fetch(hs, 0 if reverse else n - 1)
        acc = [jnp.zeros_like(a) for a in _only(cs)]
        (g_c, _, acc), (g_hs, g_ds) = jax.lax.scan(one, (g_c, start, acc), (jnp.arange(n), saved, g_ys),
                                                   reverse=not reverse, unroll=unroll)
        return (_expand(c, g_c), [jnp.zeros_like(w) for w in w0], g_hs,
                _expand(ds, g_ds), _expand(cs, acc))

    streamed.defvjp(fwd, bwd)
    return streamed(list(carry), first, stacks, [x for x, h in zip(xs, host) if not h], list(consts))


class _Step:
    """The traced step ``fn(carry, xs, *consts) -> (carry, ys)`` and its derivative, split into the
    residuals a forward step keeps and those a backward step makes again from its slices."""

    def __init__(self, fn, carry, xs, consts):
        self.fn, self.tree = fn, None
        self.closed = jax.make_jaxpr(lambda c, x, cs: jax.tree_util.tree_leaves(self._vjp(c, x, cs)[2]))(
            list(carry), list(xs), list(consts))
        # a residual no carried value flows into is made again from the slices and the constants
        self.free = jaxcompat.free_of(self.closed, [True] * len(carry) + [False] * (len(xs) + len(consts)))
        self.n_carry = len(carry)

    def _vjp(self, c, x, cs):
        """``(carry, ys, vjp)``: the step's outputs and the derivative in its inexact inputs."""
        def f(c_, x_, cs_):
            return self.fn(_put(c, c_), _put(x, x_), *_put(cs, cs_))
        (out, ys), vjp = jax.vjp(f, _only(c), _only(x), _only(cs))
        self.outs = [[(a.shape, a.dtype) for a in part] for part in (out, ys)]
        return out, ys, vjp

    def forward(self, c, x, cs, keep):
        """The step's ``(carry, ys, residuals kept)`` (none unless ``keep``)."""
        if not keep:
            out, ys = self.fn(c, x, *cs)
            return out, ys, []
        out, ys, vjp = self._vjp(c, x, cs)
        leaves, self.tree = jax.tree_util.tree_flatten(vjp)
        return out, ys, [r for r, free in zip(leaves, self.free) if not free]

    def backward(self, saved, x, cs, g_c, g_y):
        """Cotangents of the inexact carry, xs and constants, from the kept residuals, the slices
        (``x``) and the cotangents of the inexact carry and ys."""
        made = iter(jaxcompat.replay(self.closed, self.free, [None] * self.n_carry + [*x, *cs]))
        kept = iter(saved)
        vjp = jax.tree_util.tree_unflatten(self.tree, [next(made) if free else next(kept) for free in self.free])
        return vjp(tuple(_fill(g, shapes) for g, shapes in zip((g_c, g_y), self.outs)))


def _inexact(a) -> bool:
    return jnp.issubdtype(a.dtype, jnp.inexact)


def _only(arrays):
    return [a for a in arrays if _inexact(a)]


def _put(arrays, part, like=None):
    """``arrays`` with the entries inexact in ``like`` (itself by default) taken from ``part``."""
    it = iter(part)
    return [next(it) if _inexact(b) else a for a, b in zip(arrays, arrays if like is None else like)]


def _fill(grads, shapes):
    """Cotangents of outputs of ``shapes``: ``grads`` for the inexact ones, else float0 zeros."""
    it = iter(grads)
    return [next(it) if jnp.issubdtype(dtype, jnp.inexact) else np.zeros(shape, jax.dtypes.float0)
            for shape, dtype in shapes]


def _expand(arrays, grads):
    """Cotangents of every entry of ``arrays``: ``grads`` for the inexact ones, else float0 zeros."""
    it = iter(grads)
    return [next(it) if _inexact(a) else np.zeros(a.shape, jax.dtypes.float0) for a in arrays]


def _merge(mask, yes, no):
    a, b = iter(yes), iter(no)
    return [next(a) if m else next(b) for m in mask]


def _pick(stacks, j):
    return [jax.lax.dynamic_index_in_dim(s, j, 0, keepdims=False) for s in stacks]


def _fetch(stacks, j):
    """Slice ``j`` of each stack in host memory, brought to the device."""
    return [to_memory(s, "device") for s in _pick(stacks, j)]
