"""Differentiable, recorded collectives: the only module that calls jax's collective primitives.

Each function emits one collective over a tuple of mesh axes, records it (kind, axes, local shape,
bytes) in the explicit context, and carries an explicit backward rule that emits - and records -
its dual under the same origin (op and source line):

    psum (varying -> invariant)          <->  cast to varying (free)
    cast to varying (free)               <->  psum
    cast of a gathered value (free)      <->  the gathers' transpose, then psum
    psum_scatter                         <->  all_gather (varying)
    all_gather, varying result           <->  psum_scatter
    all_gather, invariant result         <->  take_block (free)
    take_block of an invariant value     <->  all_gather, invariant result
    all_to_all                           <->  all_to_all back
    ragged_all_to_all (blocks, sizes)    <->  the same with the sizes swapped
    ppermute                             <->  ppermute with the inverse permutation

"varying"/"invariant" are jax's ``shard_map`` types (``check_vma``): a value is *invariant* over a
mesh axis when every device along it holds the same value. Keeping those types exact is what makes
the backward pass communicate once per value instead of once per use: a replicated activation is
cast to varying once (cached by the context) and every consumer shares the cast, so the cotangents
are added locally and reduced by one psum.

Each collective's result carries its kind as a ``checkpoint_name`` (``"all-gather"``, ...; einsum
results are named ``"einsum"``), so remat policies choose by name what to keep for the backward
pass and what to recompute (``meshdsl.layers.with_remat``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.custom_derivatives import SymbolicZero, custom_vjp_primal_tree_values

from ..platform.jaxcompat import differentiated, pricing, varying_axes

__all__ = ["psum", "pmax", "pmin", "cast", "cast_gathered", "psum_scatter", "all_gather", "take_block",
           "all_to_all", "ragged_all_to_all", "ragged_arguments", "RAGGED_PLATFORMS", "ppermute", "axis_index",
           "replicate", "attributed_vjp", "KINDS"]

# the kinds of collective, each the checkpoint_name of its results (remat policies keep them by name)
KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all", "collective-permute")

#: the platforms whose XLA runs ``ragged-all-to-all`` (XLA:CPU lowers it and cannot compile it)
RAGGED_PLATFORMS = ("gpu", "cuda", "rocm", "tpu")


def _differentiable(x) -> bool:
    return jnp.issubdtype(x.dtype, jnp.inexact)


def attributed_vjp(ctx, forward, backward, primal=None, priced=None):
    """A ``jax.custom_vjp`` function ``f(*args) = forward(*args)[0]`` (or ``primal(*args)``, the
    same value computed without what only the gradient needs) whose rules run attributed to the
    op being lowered now: ``forward(*args) -> (out, residuals)`` (jax may run it later, e.g.
    differentiating a scan body: same origin) and ``backward(residuals, ct) -> cotangents``
    (recorded in the ``backward`` phase). Every hand-written derivative of the rewriter uses it,
    so what it emits is attributed to the user's op and line. A candidate only priced
    (:func:`meshdsl.platform.jaxcompat.pricing`) is never differentiated: it runs the primal alone, or
    ``priced`` where given (the result's shapes and types without computing it: for a local
    computation that moves nothing, a blockwise attention, tracing it is most of a candidate's cost)."""
    if pricing():
        return priced or primal or (lambda *args: forward(*args)[0])
    op, multiplier, phase, sandbox = ctx.rec.capture()

    @jax.custom_vjp
    def f(*args):
        return primal(*args) if primal is not None else forward(*args)[0]

    arity = []

    def f_fwd(*args):
        args = custom_vjp_primal_tree_values(args)
        arity[:] = [len(args)]
        with ctx.rec.origin(op, multiplier, phase, sandbox):
            return forward(*args)

    def f_bwd(res, ct):
        if isinstance(ct, SymbolicZero):   # nothing flows back: emit nothing (no collective of zeros)
            return (None,) * arity[0]
        with ctx.rec.origin(op, multiplier, "backward", sandbox):
            return backward(res, ct)

    # Symbolic zeros: a result whose cotangent is zero (read only where no gradient flows, as the
    # gathered copy :func:`cast_gathered` reads) emits no backward collective. jax would otherwise
    # pass zeros, and the collective of zeros stays in the program explain reads while XLA drops it.
    f.defvjp(f_fwd, f_bwd, symbolic_zeros=True)
    return f


def _linear(ctx, x, forward, transpose, name: str | None = None):
    """Apply the linear map ``forward`` with backward ``transpose``, attributed to the current op.
    ``name``: the collective's kind, given to the result with ``checkpoint_name`` so that remat
    policies can keep or recompute what a collective produced by name."""
    if not _differentiable(x):
        return forward(x)
    out = attributed_vjp(ctx, lambda v: (forward(v), None), lambda _, ct: (transpose(ct),))(x)
    return checkpoint_name(out, name) if name else out


def _emit(ctx, kind, axes, v, primitive, tensor):
    """Run one collective under a unique name scope (so explain can match it to the compiled
    program and drop it if dead) and record it."""
    tag = ctx.rec.tag()
    with jax.named_scope(tag):
        out = primitive(v)
    ctx.rec.record(kind, axes, v, out, tensor, tag)
    return out


def axis_index(axes) -> jax.Array:
    """Linear index of this device along ``axes`` (major first)."""
    return jax.lax.axis_index(tuple(axes)) if len(axes) > 1 else jax.lax.axis_index(axes[0])


def _gets_gradient(ctx, x) -> bool:
    """Will the backward pass send ``x`` a cotangent? (A value differentiated; in a loop body,
    which jax differentiates once it is traced, any float value: it cannot tell yet.) A constant
    (a literal scale) gets none: its cast or slice has no backward to price."""
    return _differentiable(x) and (differentiated(x) or ctx.rec.multiplier > 1 or ctx.rec.in_loop())


def _raw_vary(x, axes):
    need = tuple(a for a in axes if a not in varying_axes(x))
    return jax.lax.pcast(x, need, to="varying") if need else x


def cast(ctx, x, axes, tensor: str = "", *, grad: bool = True):
    """Invariant -> varying over ``axes`` (no data moves). Its backward is a psum; ``grad=False``:
    ``x`` gets no gradient (a ``stop_gradient``'s result), so there is none to price."""
    axes = tuple(a for a in axes if a not in varying_axes(x))
    if not axes:
        return x
    if grad and _gets_gradient(ctx, x):
        ctx.rec.cast(x, axes)
    return _linear(ctx, x, lambda v: jax.lax.pcast(v, axes, to="varying"),
                   lambda ct: psum(ctx, ct, axes, tensor + " gradient of a value replicated there"))


def cast_gathered(ctx, source, gathered, axes, ungather, tensor: str = ""):
    """Cast ``gathered`` - ``source`` gathered, ``ungather`` the gathers' transpose - to varying
    over ``axes`` (no data moves). Its backward sums the cotangent over ``axes`` once un-gathered,
    on ``source``'s block, where :func:`cast`'s psum would sum the gathered block: the same
    gradient (the gathers run over other axes), fewer bytes. The gradient goes to ``source``
    directly; ``gathered``, shared with other readers, gets none from here."""
    axes = tuple(a for a in axes if a not in varying_axes(gathered))
    if not axes or not _differentiable(gathered):
        return jax.lax.pcast(gathered, axes, to="varying") if axes else gathered
    ctx.rec.cast(source, axes)
    return attributed_vjp(
        ctx, lambda s, g: (jax.lax.pcast(g, axes, to="varying"), None),
        lambda _, ct: (psum(ctx, ungather(ct), axes, tensor + " gradient of a value replicated there"), None),
    )(source, gathered)


def psum(ctx, x, axes, tensor: str = ""):
    """Sum partial values over ``axes``; the result is invariant there."""
    axes = tuple(axes)
    if not axes:
        return x
    x = cast(ctx, x, axes, tensor)

    def forward(v):
        return _emit(ctx, "all-reduce", axes, v, lambda u: jax.lax.psum(u, axes), tensor)

    def transpose(ct):
        varying = tuple(a for a in axes if a in varying_axes(ct))
        if varying:  # a consumer treated the sum as varying: add those cotangents first
            ct = psum(ctx, ct, varying, tensor)
        return cast(ctx, ct, axes, tensor)

    return _linear(ctx, x, forward, transpose, "all-reduce")


def pmax(ctx, x, axes, tensor: str = ""):
    """Maximum over ``axes`` of a statistic (no gradient: callers stop it)."""
    axes = tuple(axes)
    x = jax.lax.stop_gradient(_raw_vary(x, axes))
    return _emit(ctx, "all-reduce", axes, x, lambda u: jax.lax.pmax(u, axes), tensor)


def pmin(ctx, x, axes, tensor: str = ""):
    """Minimum over ``axes`` of a statistic (no gradient: callers stop it)."""
    axes = tuple(axes)
    x = jax.lax.stop_gradient(_raw_vary(x, axes))
    return _emit(ctx, "all-reduce", axes, x, lambda u: jax.lax.pmin(u, axes), tensor)


def psum_scatter(ctx, x, axes, dim: int, tensor: str = ""):
    """Reduce-scatter: sum partial values over ``axes`` and keep this device's block of ``dim``."""
    axes = tuple(axes)
    x = cast(ctx, x, axes, tensor)

    def forward(v):
        return _emit(ctx, "reduce-scatter", axes, v,
                     lambda u: jax.lax.psum_scatter(u, axes, scatter_dimension=dim, tiled=True), tensor)

    return _linear(ctx, x, forward, lambda ct: all_gather(ctx, ct, axes, dim, invariant=False, tensor=tensor),
                   "reduce-scatter")


def all_gather(ctx, x, axes, dim: int, *, invariant: bool, tensor: str = ""):
    """Concatenate the blocks of ``dim`` over ``axes``. ``invariant`` types the result as replicated
    (its backward then only takes this device's block); otherwise it stays varying (backward:
    reduce-scatter)."""
    axes = tuple(axes)
    x = cast(ctx, x, axes, tensor)

    to = "invarying" if invariant else "varying"

    def forward(v):
        return _emit(ctx, "all-gather", axes, v,
                     lambda u: jax.lax.all_gather(u, axes, axis=dim, tiled=True, to=to), tensor)

    if invariant:
        return _linear(ctx, x, forward, lambda ct: take_block(ctx, ct, axes, dim, tensor), "all-gather")
    return _linear(ctx, x, forward, lambda ct: psum_scatter(ctx, ct, axes, dim, tensor), "all-gather")


def _slice_block(v, axes, dim: int, block: int):
    return jax.lax.dynamic_slice_in_dim(v, axis_index(axes) * block, block, axis=dim)


def take_block(ctx, x, axes, dim: int, tensor: str = ""):
    """This device's block of ``dim`` along ``axes``: a local slice, no communication. For a value
    replicated over an axis, the backward all-gathers the block cotangents (not an all-reduce)."""
    for a in axes:  # one axis at a time, major first, so each can keep its own type
        block = x.shape[dim] // ctx.axes_size((a,))
        if a in varying_axes(x):
            x = _slice_block(x, (a,), dim, block)
        else:
            x = _linear(ctx, x, lambda v, a=a, block=block: _slice_block(_raw_vary(v, (a,)), (a,), dim, block),
                        lambda ct, a=a: all_gather(ctx, ct, (a,), dim, invariant=True, tensor=tensor))
            if _gets_gradient(ctx, x):
                ctx.rec.sliced(x, (a,))
    return x


def all_to_all(ctx, x, axes, split_dim: int, concat_dim: int, tensor: str = ""):
    """Move the split over ``axes`` from ``concat_dim`` (becomes whole) to ``split_dim``."""
    axes = tuple(axes)
    x = cast(ctx, x, axes, tensor)

    def forward(v):
        return _emit(ctx, "all-to-all", axes, v,
                     lambda u: jax.lax.all_to_all(u, axes, split_dim, concat_dim, tiled=True), tensor)

    return _linear(ctx, x, forward, lambda ct: all_to_all(ctx, ct, axes, concat_dim, split_dim, tensor),
                   "all-to-all")


def ragged_arguments(n: int, block: int, me, send_sizes, recv_sizes):
    """``jax.lax.ragged_all_to_all``'s ``(input_offsets, send_sizes, output_offsets, recv_sizes)``
    for the block layout of :func:`ragged_all_to_all`: the rows for device ``j`` start at ``j *
    block`` here and land at ``me * block`` there (``me``: this device's index)."""
    starts = jnp.arange(n, dtype=jnp.int32) * block
    lands = jnp.broadcast_to(jnp.asarray(me, jnp.int32) * block, (n,))
    return starts, send_sizes.astype(jnp.int32), lands, recv_sizes.astype(jnp.int32)


def ragged_all_to_all(ctx, x, axes, send_sizes, recv_sizes, tensor: str = ""):
    """Exchange blocks of rows, sending only the rows each holds: ``x`` ``[n * block, ...]``, its
    block ``j`` for device ``j`` of ``axes``, of which the first ``send_sizes[j]`` rows are sent
    (the rest are padding); the result, the same shape, holds in block ``s`` the
    ``recv_sizes[s]`` rows device ``s`` sent here, then zeros (``recv_sizes`` is the all-to-all
    of the senders' ``send_sizes``). Where XLA has the collective (:data:`RAGGED_PLATFORMS`) it
    is one ``ragged_all_to_all`` - explain counts its whole buffer, the most it can move; on
    XLA:CPU the padding is zeroed and the blocks go whole in one ``all_to_all`` (the same
    values, the padded bytes). Backward: the same exchange with the sizes swapped."""
    axes = tuple(axes)
    x = cast(ctx, x, axes, tensor)
    n = ctx.axes_size(axes)
    block = x.shape[0] // n

    def exchange(v, send, recv):
        if ctx.mesh.platform not in RAGGED_PLATFORMS:
            blocks = v.reshape(n, block, *v.shape[1:])
            live = (jnp.arange(block)[None, :] < send[:, None]).reshape(n, block, *(1,) * (v.ndim - 1))
            masked = jnp.where(live, blocks, jnp.zeros((), v.dtype)).reshape(v.shape)
            return _emit(ctx, "all-to-all", axes, masked,
                         lambda u: jax.lax.all_to_all(u, axes, 0, 0, tiled=True), tensor)
        args = (jnp.zeros_like(v), *ragged_arguments(n, block, axis_index(axes), send, recv))   # (outside its scope)
        name = axes if len(axes) > 1 else axes[0]
        return _emit(ctx, "ragged-all-to-all", axes, v,
                     lambda u: jax.lax.ragged_all_to_all(u, *args, axis_name=name), tensor)

    if not _differentiable(x):
        return exchange(x, send_sizes, recv_sizes)
    out = attributed_vjp(ctx, lambda v, s, r: (exchange(v, s, r), (s, r)),
                         lambda res, ct: (ragged_all_to_all(ctx, ct, axes, res[1], res[0], tensor), None, None),
                         primal=exchange)(x, send_sizes, recv_sizes)
    return checkpoint_name(out, "all-to-all")


def ppermute(ctx, x, axes, perm, tensor: str = ""):
    """Send this device's value to another along ``axes`` (``perm``: (source, target) pairs of linear
    indices); devices that receive nothing get zeros."""
    axes, perm = tuple(axes), tuple(perm)
    x = cast(ctx, x, axes, tensor)
    # jax numbers ppermute's devices in mesh order, whatever order ``axes`` lists; ``perm`` uses
    # the order of ``axes`` (a dim's block order, as axis_index / all_gather do): translate.
    ordered = tuple(a for a in ctx.mesh.factor_axes if a in axes)
    if ordered != axes:
        sizes = {a: ctx.axes_size((a,)) for a in axes}

        def to_mesh_order(i):
            coords = {}
            for a in reversed(axes):
                i, coords[a] = divmod(i, sizes[a])
            j = 0
            for a in ordered:
                j = j * sizes[a] + coords[a]
            return j

        perm = tuple((to_mesh_order(s), to_mesh_order(t)) for s, t in perm)
        axes = ordered
    name = axes if len(axes) > 1 else axes[0]

    def forward(v):
        return _emit(ctx, "collective-permute", axes, v, lambda u: jax.lax.ppermute(u, name, perm), tensor)

    inverse = tuple((t, s) for s, t in perm)
    return _linear(ctx, x, forward, lambda ct: ppermute(ctx, ct, axes, inverse, tensor), "collective-permute")


def replicate(ctx, x, axes, tensor: str = ""):
    """Type a value that is equal on every device along ``axes`` (but typed varying) as invariant:
    keep the first device's copy and sum - one all-reduce, recorded."""
    axes = tuple(axes)
    if not axes:
        return x
    dtype = x.dtype
    v = x.astype(jnp.int32) if dtype == jnp.bool_ else x
    v = jnp.where(axis_index(axes) == 0, v, jnp.zeros((), v.dtype))
    return psum(ctx, v, axes, tensor).astype(dtype)
