"""Blockwise online-softmax attention on one device's arrays (flash attention, in jax.numpy).

Arrays here are plain jax arrays whose axes are *named* by a :class:`Spec` (the op rule in
:mod:`meshdsl.ops.attention` builds it from the NamedArrays' dims), so nothing is positional:

    s[stats, over]   = scale * (q · k over features) + bias + (0 where allowed, else float32 min)
    m, l             = running max and sum of exp(s - m) over ``over``, block by block
    out[..]          = (sum over over of exp(s - m) * v) / l           lse = m + log(l)

``stats`` are q's dims less the features (batch, heads, groups, length). Keys and values are
visited in blocks of ``block`` positions (a ``lax.scan``), so no ``[length, kv_length]`` logits
exist beyond one block, forward or backward: the backward pass recomputes each block's logits from
q, k and the saved ``lse`` (FlashAttention-2's recurrence: ``ds = p * (dp - D)``,
``D = sum(dout * out) - dlse``).

Queries are visited in blocks of ``q_block`` positions too; with a causal mask a tile (a query
block against a key block) whose keys all come after its queries is skipped (``lax.cond`` on
the tile's global positions), forward and backward: causal attention does about half the work,
and :func:`meshdsl.ops.balance.tiles` counts the tiles each device computes.

A *chunk* is the keys and values one device holds at one step of context parallelism (its own,
or one received in a ring): :func:`forward_chunk` folds a chunk into the running statistics,
:func:`backward_chunk` gives the chunk's gradients and its part of ``dq``. Single-device attention
is one chunk; :func:`attend` and :func:`attend_backward` are that case.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from ..platform.jaxcompat import varying_axes

__all__ = ["Spec", "Chunk", "MASK_VALUE", "attend", "attend_backward", "forward_chunk", "finish",
           "backward_chunk", "start", "block_size", "expand", "dot_product"]

MASK_VALUE = float(jnp.finfo(jnp.float32).min)   # added to a masked logit, as Hugging Face's T5 does
_LETTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"


@dataclasses.dataclass(frozen=True)
class Spec:
    """Names of each local array's axes, and the attention's constants."""

    q: tuple           # q's dims
    k: tuple           # k's dims (contain ``over`` and the features)
    v: tuple           # v's dims (contain ``over``)
    out: tuple         # the result's dims: q's, features replaced by v's
    length: str        # q's position dim
    over: str          # the keys' position dim
    features: tuple    # contracted by q · k
    scale: float
    causal: bool
    bias: tuple | None = None    # the bias's dims (a subset of stats + over), if any
    mask: tuple | None = None    # the mask's dims (a subset of stats + over), if any
    bias_fn: object = None       # the bias of a tile from its positions: bias_fn(table, q_pos, kv_pos)

    @property
    def stats(self) -> tuple:
        return tuple(n for n in self.q if n not in self.features)

    def letters(self, *groups) -> str:
        every = list(dict.fromkeys(n for g in (self.q, self.k, self.v, self.out) for n in g))
        return ",".join("".join(_LETTERS[every.index(n)] for n in g) for g in groups)


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One device's keys and values at one step, with what is laid out along ``over`` like them:
    the bias and mask columns, and the keys' global positions (a vector along ``over``).
    ``table``: the parameters of ``spec.bias_fn`` (a pytree; then ``bias`` is None)."""

    k: jax.Array
    v: jax.Array
    bias: jax.Array | None
    mask: jax.Array | None
    positions: jax.Array
    table: object = None


jax.tree_util.register_dataclass(Chunk, data_fields=["k", "v", "bias", "mask", "positions", "table"], meta_fields=[])


def expand(x, names, target):
    """``x`` (axes ``names``, a subset of ``target``) transposed and reshaped to broadcast against
    an array with axes ``target``."""
    order = [n for n in target if n in names]
    x = jnp.transpose(x, [names.index(n) for n in order])
    return x.reshape([x.shape[order.index(n)] if n in order else 1 for n in target])


def _einsum(spec, sub_a, a, sub_b, b, out, dtype=jnp.float32):
    return jnp.einsum(f"{spec.letters(sub_a, sub_b)}->{spec.letters(out)}", a, b, preferred_element_type=dtype)


def _tile_bias(spec, c: Chunk, q_positions):
    """The bias of a tile: its columns of the given bias, or ``bias_fn`` of its positions."""
    if spec.bias_fn is not None:
        return spec.bias_fn(c.table, q_positions, c.positions)
    return c.bias


def _logits(spec, q, c: Chunk, q_positions, bias=None):
    """``s[stats, over]`` of one block: scaled, biased, masked (float32). ``bias``: the tile's
    (default: :func:`_tile_bias`)."""
    target = (*spec.stats, spec.over)
    s = _einsum(spec, spec.q, q, spec.k, c.k, target) * spec.scale
    bias = _tile_bias(spec, c, q_positions) if bias is None else bias
    if bias is not None:
        s = s + expand(bias.astype(jnp.float32), spec.bias, target)
    allowed = None
    if spec.causal:
        allowed = expand(c.positions[None, :] <= q_positions[:, None], (spec.length, spec.over), target)
    if c.mask is not None:
        m = expand(c.mask, spec.mask, target)
        allowed = m if allowed is None else allowed & m
    if allowed is not None:
        s = s + jnp.where(allowed, 0.0, MASK_VALUE)
    return s


def _like(x, *refs):
    """``x`` typed varying over every mesh axis one of ``refs`` varies over (inside ``shard_map``,
    a loop's carry must be typed as what the loop computes from ``refs``)."""
    axes = set().union(*(varying_axes(r) for r in refs if r is not None)) - varying_axes(x)
    return jax.lax.pcast(x, tuple(sorted(axes)), to="varying") if axes else x


def block_size(n: int, block: int | None) -> int:
    """The largest divisor of ``n`` positions not over ``block`` (default 512)."""
    block = min(n, block or 512)
    while n % block:
        block -= 1
    return block


def _cut(x, names, dim, n):
    """``x`` cut along ``dim`` into ``n`` blocks: a leading blocks axis (a scan's xs)."""
    if x is None or dim not in names:
        return x
    i = names.index(dim)
    shape = x.shape[:i] + (n, x.shape[i] // n) + x.shape[i + 1:]
    return jnp.moveaxis(x.reshape(shape), i, 0)


def _joined(x, names, dim):
    """A scan's ys (leading blocks axis) back to one array along ``dim``."""
    i = names.index(dim)
    x = jnp.moveaxis(x, 0, i)
    return x.reshape(x.shape[:i] + (x.shape[i] * x.shape[i + 1],) + x.shape[i + 2:])


_FIELDS = ("k", "v", "bias", "mask", "positions")


def _names(spec) -> dict:
    return {"k": spec.k, "v": spec.v, "bias": spec.bias, "mask": spec.mask, "positions": (spec.over,)}


def _split(spec, c: Chunk, dim: str, n: int):
    """Chunk ``c``'s fields cut into ``n`` blocks along ``dim`` (those that have it: scanned) and
    the others (shared by every block)."""
    names = _names(spec)
    scanned = {f: _cut(getattr(c, f), names[f], dim, n) for f in _FIELDS
               if getattr(c, f) is not None and dim in (names[f] or ())}
    shared = {f: getattr(c, f) for f in (*_FIELDS, "table") if f not in scanned}
    return scanned, shared


def _visible(spec, b: Chunk, q_positions):
    """Does any query of the tile see any of its keys (causal: a key not after a query)?"""
    if not spec.causal:
        return None
    return jnp.min(b.positions) <= jnp.max(q_positions)


def _over_kv(spec, step, skip, carry, c: Chunk, q_positions, block):
    """``step(carry, key block)`` over the key blocks of chunk ``c``; a tile no query sees takes
    ``skip(carry, key block)`` instead."""
    n = c.k.shape[spec.k.index(spec.over)] // block_size(c.k.shape[spec.k.index(spec.over)], block)
    if n == 1:   # one tile: no loop, no branch (a smaller program to compile; skipping saves nothing)
        carry, ys = step(carry, c)
        return carry, jax.tree.map(lambda y: y[None], ys)
    scanned, shared = _split(spec, c, spec.over, n)

    def body(carry, sliced):
        b = Chunk(**{**shared, **sliced})
        seen = _visible(spec, b, q_positions)
        if seen is None:
            return step(carry, b)
        return jax.lax.cond(seen, step, skip, carry, b)

    return jax.lax.scan(body, carry, scanned)


def _over_q(spec, one, c: Chunk, per_q: dict, q_block: int | None, length: int):
    """``one(chunk, **per_q block)`` for each block of ``q_block`` queries (``per_q``: name ->
    (array, its dims), cut along ``length``; the chunk's bias and mask too): ``lax.map``."""
    n = length // block_size(length, q_block)
    if n == 1:
        return one(c, **{k: a for k, (a, _) in per_q.items()}), 1
    scanned, shared = _split(spec, c, spec.length, n)
    xs = {k: _cut(a, names, spec.length, n) for k, (a, names) in per_q.items()}

    def body(x):
        sliced, rest = x
        return one(Chunk(**{**shared, **sliced}), **rest)

    return jax.lax.map(body, (scanned, xs)), n


def start(spec, q):
    """Running statistics ``(m, l)`` before any key: max -inf, sum 0."""
    shapes = dict(zip(spec.q, q.shape))
    stats = tuple(shapes[n] for n in spec.stats)
    return jnp.full(stats, -jnp.inf, jnp.float32), jnp.zeros(stats, jnp.float32)


def _tied(q, c: Chunk, q_positions):
    """The positions tied to ``q`` (an optimization barrier): what is computed from positions
    alone per tile (the causal masks, a bias from positions) then depends on the data, so neither
    jax (a scan's loop-invariant residuals, once per layer stack) nor XLA hoists it out of the
    loops over layers and tiles, where it would be held for every tile at once."""
    q_positions, kv_positions, q = jax.lax.optimization_barrier((q_positions, c.positions, q))
    return q, dataclasses.replace(c, positions=kv_positions), q_positions


def forward_chunk(spec, q, c: Chunk, q_positions, state, block: int | None = None, q_block: int | None = None):
    """Fold chunk ``c`` into ``state = (m, l, acc)`` (``acc`` over ``spec.out``, float32; None
    before the first chunk)."""
    q, c, q_positions = _tied(q, c, q_positions)
    m, l, acc = state
    st = spec.stats
    if acc is None:
        shapes = {**dict(zip(spec.q, q.shape)), **dict(zip(spec.v, c.v.shape))}
        acc = jnp.zeros([shapes[n] for n in spec.out], jnp.float32)
    refs = (q, c.k, c.v, c.bias, c.mask, c.positions, q_positions)
    m, l, acc = (_like(x, *refs) for x in (m, l, acc))

    def one(c, q, qp, m, l, acc):
        def step(carry, b: Chunk):
            m, l, acc = carry
            s = _logits(spec, q, b, qp)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1))
            p = jnp.exp(s - m_new[..., None])
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=-1)
            pv = _einsum(spec, (*st, spec.over), p.astype(b.v.dtype), spec.v, b.v, spec.out)
            return (m_new, l, acc * expand(corr, st, spec.out) + pv), None

        return _over_kv(spec, step, lambda carry, b: (carry, None), (m, l, acc), c, qp, block)[0]

    per_q = {"q": (q, spec.q), "qp": (q_positions, (spec.length,)), "m": (m, st), "l": (l, st), "acc": (acc, spec.out)}
    (m, l, acc), n = _over_q(spec, one, c, per_q, q_block, q.shape[spec.q.index(spec.length)])
    if n > 1:
        m, l, acc = _joined(m, st, spec.length), _joined(l, st, spec.length), _joined(acc, spec.out, spec.length)
    return m, l, acc


def finish(spec, state, dtype):
    """``(out, lse)`` from the running statistics (a query that saw no key: zeros)."""
    m, l, acc = state
    seen = l > 0
    out = acc / expand(jnp.where(seen, l, 1.0), spec.stats, spec.out)
    return out.astype(dtype), jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)


def backward_chunk(spec, q, c: Chunk, q_positions, lse, dout, delta, block: int | None = None,
                   q_block: int | None = None):
    """Gradients of chunk ``c``: ``(dq part, dk, dv, dbias)`` given the forward's ``lse`` and
    ``delta = sum(dout * out over v's features) - dlse`` (both over ``stats``); ``dbias`` is the
    gradient of the bias's columns, or with ``bias_fn`` of its ``table``."""
    st = spec.stats
    q, c, q_positions = _tied(q, c, q_positions)
    refs = (q, c.k, c.v, c.bias, c.mask, c.positions, q_positions, dout, lse)

    def one(c, q, qp, lse, dout, delta):
        def step(carry, b: Chunk):
            dq, dtable = carry
            bias, pull = _bias_and_pullback(spec, b, qp)
            s = _logits(spec, q, b, qp, bias)
            seen = jnp.isfinite(lse)[..., None]      # -inf: a query that saw no key at all
            p = jnp.where(seen, jnp.exp(s - jnp.where(seen, lse[..., None], 0.0)), 0.0)
            dv = _einsum(spec, (*st, spec.over), p.astype(dout.dtype), spec.out, dout, spec.v)
            dp = _einsum(spec, spec.out, dout, spec.v, b.v, (*st, spec.over))
            ds = p * (dp - delta[..., None])
            dq = dq + _einsum(spec, (*st, spec.over), ds, spec.k, b.k, spec.q) * spec.scale
            dk = _einsum(spec, (*st, spec.over), ds, spec.q, q, spec.k) * spec.scale
            db = None if bias is None else jnp.einsum(
                f"{spec.letters((*st, spec.over))}->{spec.letters(spec.bias)}", ds).astype(jnp.float32)
            if pull is not None:   # the table's gradient, accumulated; no columns to return
                dtable = jax.tree.map(jnp.add, dtable, pull(db.reshape(bias.shape).astype(bias.dtype))[0])
                db = None
            return (dq, dtable), (dk.astype(b.k.dtype), dv.astype(b.v.dtype), db)

        def skip(carry, b: Chunk):
            return carry, jax.tree.map(jnp.zeros_like, step(carry, b)[1])   # (the values unused: dead code)

        dq0 = _like(jnp.zeros(q.shape, jnp.float32), *refs)
        table0 = jax.tree.map(lambda t: _like(jnp.zeros_like(t), *refs), c.table)
        (dq, dtable), (dk, dv, db) = _over_kv(spec, step, skip, (dq0, table0), c, qp, block)
        dk, dv = _joined(dk, spec.k, spec.over), _joined(dv, spec.v, spec.over)
        if db is not None:
            db = _joined(db, spec.bias, spec.over) if spec.over in spec.bias else db.sum(0)
        return dq, dk, dv, dtable if spec.bias_fn is not None else db

    per_q = {"q": (q, spec.q), "qp": (q_positions, (spec.length,)), "lse": (lse, st), "dout": (dout, spec.out),
             "delta": (delta, st)}
    dq, dk, dv, db = _summed_over_q(spec, one, c, per_q, q_block, q.shape[spec.q.index(spec.length)], refs)
    if spec.bias_fn is not None or db is None:
        return dq, dk, dv, db
    return dq, dk, dv, db.astype(c.bias.dtype)


def _summed_over_q(spec, one, c: Chunk, per_q: dict, q_block, length: int, refs):
    """``one`` for each block of queries (a ``lax.scan``): ``dq`` (and a bias's gradient along
    ``length``) per block, joined; the chunk's ``dk``, ``dv`` (and the table's or a bias's without
    ``length``) summed in the carry, so the pass holds one chunk's gradients, not one per block."""
    n = length // block_size(length, q_block)
    if n == 1:
        return one(c, **{k: a for k, (a, _) in per_q.items()})
    scanned, shared = _split(spec, c, spec.length, n)
    xs = {k: _cut(a, names, spec.length, n) for k, (a, names) in per_q.items()}
    along = spec.bias_fn is None and spec.bias is not None and spec.length in spec.bias   # db per block

    def body(carry, x):
        sliced, rest = x
        dq, dk, dv, db = one(Chunk(**{**shared, **sliced}), **rest)
        summed = (dk, dv, None if along else db)
        carry = jax.tree.map(lambda a, b: a + b.astype(a.dtype), carry, summed)
        return carry, (dq, db if along else None)

    first = jax.eval_shape(lambda: _summed_shapes(one, shared, scanned, xs, along))
    zeros = jax.tree.map(lambda t: _like(jnp.zeros(t.shape, jnp.float32), *refs), first)
    (dk, dv, db), (dq, db_along) = jax.lax.scan(body, zeros, (scanned, xs))
    dk, dv = dk.astype(c.k.dtype), dv.astype(c.v.dtype)
    dq = _joined(dq, spec.q, spec.length)
    return dq, dk, dv, _joined(db_along, spec.bias, spec.length) if along else db


def _summed_shapes(one, shared, scanned, xs, along):
    """The summed parts of ``one`` on the first block of queries (their shapes seed the carry)."""
    first = jax.tree.map(lambda a: a[0], (scanned, xs))
    _, dk, dv, db = one(Chunk(**{**shared, **first[0]}), **first[1])
    return dk, dv, None if along else db


def _bias_and_pullback(spec, b: Chunk, q_positions):
    """The tile's bias, and with ``bias_fn`` the pullback to its table (None otherwise)."""
    if spec.bias_fn is None:
        return b.bias, None
    return jax.vjp(lambda table: spec.bias_fn(table, q_positions, b.positions), b.table)


def attend(spec, q, c: Chunk, q_positions, block=None, q_block=None):
    """Single-chunk attention: ``(out, lse)``."""
    m, l = start(spec, q)
    return finish(spec, forward_chunk(spec, q, c, q_positions, (m, l, None), block, q_block), c.v.dtype)


def attend_types(spec, q, c: Chunk, q_positions):
    """What :func:`attend` returns, as zeros of its shapes and types (the mesh axes each varies
    over included) without computing it: what a candidate only priced needs."""
    size = {**dict(zip(spec.q, q.shape)), **dict(zip(spec.k, c.k.shape)), **dict(zip(spec.v, c.v.shape))}
    reads = (q, c.k, c.v, c.bias, c.mask, c.positions, q_positions, *jax.tree_util.tree_leaves(c.table))
    return (_like(jnp.zeros([size[n] for n in spec.out], c.v.dtype), *reads),   # the loop's carry: both
            _like(jnp.zeros([size[n] for n in spec.stats], jnp.float32), *reads))   # read everything


def attend_backward(spec, q, c: Chunk, q_positions, out, lse, dout, dlse, block=None, q_block=None):
    """``(dq, dk, dv, dbias)`` of :func:`attend`."""
    delta = jnp.einsum(f"{spec.letters(spec.out, spec.out)}->{spec.letters(spec.stats)}",
                       dout.astype(jnp.float32), out.astype(jnp.float32))
    if dlse is not None:
        delta = delta - dlse
    dq, dk, dv, db = backward_chunk(spec, q, c, q_positions, lse, dout, delta, block, q_block)
    return dq.astype(q.dtype), dk, dv, db


def dot_product(spec, q, c: Chunk, q_positions, implementation: str, aligned: bool = False):
    """The same attention by ``jax.nn.dot_product_attention`` (``"cudnn"``: the GPU's fused
    kernel; ``"xla"``: its reference, logits materialised): q's dims that k shares (batch,
    kv heads) become its batch, q's own dims (groups) its heads over one kv head. The causal
    mask is ``is_causal`` where the positions are ``0 .. n-1`` on both sides (``aligned``), else a mask."""
    shared = [n for n in spec.stats if n in spec.k]
    own = [n for n in spec.stats if n not in spec.k and n != spec.length]
    v_feats = [n for n in spec.out if n not in spec.stats]
    size = {**dict(zip(spec.q, q.shape)), **dict(zip(spec.k, c.k.shape)), **dict(zip(spec.v, c.v.shape))}
    b, g = int(np.prod([size[n] for n in shared])), int(np.prod([size[n] for n in own]))
    t, s = size[spec.length], size[spec.over]

    def arrange(x, names, order, shape):
        return jnp.transpose(x, [names.index(n) for n in order]).reshape(shape)

    qa = arrange(q, spec.q, [*shared, spec.length, *own, *spec.features], (b, t, g, -1))
    ka = arrange(c.k, spec.k, [*shared, spec.over, *spec.features], (b, s, 1, -1))
    va = arrange(c.v, spec.v, [*shared, spec.over, *v_feats], (b, s, 1, -1))
    grid = (*shared, *own, spec.length, spec.over)

    def full(x, names):
        return None if x is None else jnp.broadcast_to(
            expand(x, names, grid), [size[n] for n in grid]).reshape(b, g, t, s)
    bias = c.bias if spec.bias_fn is None else spec.bias_fn(c.table, q_positions, c.positions)
    bias, mask = full(bias, spec.bias), full(c.mask, spec.mask)
    causal = spec.causal and aligned
    if spec.causal and not causal:
        seen = full(c.positions[None, :] <= q_positions[:, None], (spec.length, spec.over))
        mask = seen if mask is None else mask & seen
    out = jax.nn.dot_product_attention(qa, ka, va, bias, mask, scale=spec.scale, is_causal=causal,
                                       implementation=implementation)
    out = out.reshape([size[n] for n in (*shared, spec.length, *own, *v_feats)])
    order = [*shared, spec.length, *own, *v_feats]
    return jnp.transpose(out, [order.index(n) for n in spec.out])
