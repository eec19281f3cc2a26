"""``md.expert_ffn`` and ``md.ragged_dot``: token-choice experts as grouped matmuls, dropless.

    out[tokens, choice, d_out] = FFN_{index[tokens, choice]}(x[tokens, d_model])

Each token's ``choice`` picks an expert (``index``, integers in ``0 .. experts-1``); the expert's
feed-forward runs on it: one kernel ``w[experts, d_model, d_out]`` (:func:`ragged_dot`, a gathered-
weight matmul), two (``w_out · act(x · w_in)``) or three (gated: ``w_out · (act(x · w_gate) *
(x · w_up))``, SwiGLU with ``activation="silu"``). No capacity, no token dropped: the result is
the unsharded program's under every layout. The caller weighs and sums the choices (``md.einsum``
with the gates over ``choice``).

Locally the assignments (token, choice) are sorted by expert and the experts run as grouped
matmuls over the sorted rows (``jax.lax.ragged_dot``: a grouped GEMM where the backend has one;
XLA:CPU expands it into one masked matmul per group), then unsorted. Where it computes, per the
op's placement (its strategies):

* ``experts`` whole: ``local`` - every device runs its tokens through all experts;
* ``experts`` split on axes ``A`` and the tokens split on ``A`` too (expert parallelism,
  ``batch: data, experts: data``): ``exchange`` - each device sorts its assignments by the device
  holding their expert and sends them in **one all-to-all** of a static buffer (plus one of the
  ``[devices, local experts]`` counts), the owners run their experts, and **one all-to-all**
  brings the results back (the backward pass mirrors the two). The buffer holds, per destination,
  ``tokens * min(choices, local experts)`` rows: the most a device's tokens can send to one device
  (a token picks an expert once), so nothing is ever dropped whatever the routing;
* ``experts`` split on ``A``, the tokens whole there: ``partial`` - each device runs the
  assignments to its own experts, the rest give zeros, and the result is a pending sum over ``A``;
* the hidden dim (``d_ff``) split on ``B`` (Megatron inside each expert): local slices of the
  kernels, the output a pending sum over ``B`` (one all-reduce where it is used);
* ``d_model`` is gathered where the layout splits it (the kernels contract it whole).

Strategies compose: ``experts: data, d_ff: model`` exchanges over ``data`` and leaves a pending
sum over ``model``. ZeRO-3 storage of the kernels is the layout's business (gathered on use).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from ..names.dims import Shape
from ..names.errors import ShapeError, suggest
from ..rewrite import collectives as C
from . import grouped
from .common import as_named, decided, union_dims, where_
from .registry import op

__all__ = ["expert_ffn", "ragged_dot", "ACTIVATIONS", "EXCHANGES", "exchange_rows"]

ACTIVATIONS = {"relu": jax.nn.relu, "gelu": lambda v: jax.nn.gelu(v, approximate=False),
               "gelu_new": lambda v: jax.nn.gelu(v, approximate=True), "silu": jax.nn.silu,
               "swish": jax.nn.silu, "identity": lambda v: v}
EXCHANGES = ("ragged", "padded")


@op("expert_ffn")
def expert_ffn(ctx, x, index, kernels, *, experts: str = "experts", choice: str | None = None,
               activation: str = "silu", distinct: bool = False, kernel: str | None = None,
               exchange_factor: float | None = None, exchange: str | None = None):
    """Each token's chosen experts' feed-forward: ``x`` ``[*tokens, d_model]``, ``index`` integer
    ``[*tokens, choice]``, ``kernels`` one, two or three ``[experts, d_in, d_out]`` chained as the
    module docstring says (three: gated). ``activation``: ``relu``, ``gelu``, ``gelu_new``,
    ``silu``/``swish`` or ``identity``. ``distinct``: each token's choices are different experts
    (a top-k's are), which bounds what one device can send another by ``min(choices, local
    experts)`` rows per token (else ``choices``). An expert number outside ``0 .. experts-1``
    gives zeros. ``kernel``: the local grouped matmul, ``"ragged"`` or ``"tiled"``
    (:mod:`meshdsl.ops.grouped`; default: the planner's choice by time, the one with fewer FLOPs
    outside a planned lowering). ``exchange_factor``: under expert parallelism, each destination's
    buffer holds ``exchange_factor`` times a balanced routing's rows (at most the never-dropping
    size, the default); then returns ``(out, dropped)``, ``dropped`` the fraction of assignments
    that did not fit (zeros in ``out``), to be checked (:class:`meshdsl.layers.DroplessMoE`
    reports it, the trainer stops on it). ``exchange``: how expert parallelism sends the rows,
    ``"ragged"`` (only the rows each destination gets, one ``ragged_all_to_all``: the default
    where XLA has it, GPU and TPU; emulated by the padded exchange on XLA:CPU) or ``"padded"``
    (the whole static buffer, one ``all_to_all``; the default elsewhere). Returns ``[*tokens,
    choice, d_out]``."""
    x, index = as_named(ctx, x, "x"), as_named(ctx, index, "index")
    kernels = [as_named(ctx, w, f"kernel {i + 1}") for i, w in enumerate(kernels)]
    spec = _spec(ctx, x, index, kernels, experts, choice, activation)
    if kernel is not None and kernel not in grouped.KERNELS:   # (checked before any work)
        raise ShapeError(f"{where_(ctx)}: kernel must be one of {grouped.KERNELS} or None, got {kernel!r}")
    if exchange not in (None, *EXCHANGES):
        raise ShapeError(f"{where_(ctx)}: exchange must be one of {EXCHANGES} or None, got {exchange!r}")
    dims = union_dims(ctx, [x, index, *kernels])
    axes, strategy = _placed(ctx, spec, dims, x, index, kernels)
    ep = axes[experts]
    hidden = axes[spec.hidden] if len(kernels) > 1 else ()
    vary = ctx.vary(axes.values(), [x, index, *kernels])
    xl = ctx.local(x, axes, vary)
    il = ctx.local(index, axes, vary)
    wl = [_ordered(ctx.local(w, axes, vary), w.names, roles) for w, roles in zip(kernels, spec.roles)]
    out, dropped = _compute(ctx, spec, dims, axes, strategy, (xl, x.names), (il, index.names), wl, distinct, kernel,
                            (exchange_factor, exchange))
    out_dims = Shape([*(dims[n] for n in spec.tokens), dims[spec.choice], dims[spec.d_out]])
    pending = frozenset(hidden) | (frozenset(ep) if strategy == "partial" else frozenset())
    out = ctx.out(out, out_dims, axes, pending=pending)
    if exchange_factor is None:
        return out
    tokens = frozenset(a for n in spec.tokens for a in axes[n]) if strategy == "exchange" else frozenset()
    return out, ctx.out(dropped, Shape(()), {}, pending=tokens)


def _compute(ctx, spec, dims, axes, strategy, x, index, kernels, distinct, kernel, exchange):
    """``(out [*tokens, choice, d_out] local, this device's share of the dropped fraction)``."""
    (xl, x_names), (il, index_names), (factor, exchange) = x, index, exchange
    ep = axes[spec.experts]
    token_shape = [xl.shape[x_names.index(n)] for n in spec.tokens]
    rows = _flat(xl, x_names, (*spec.tokens, spec.d_in), 2)
    chosen = _flat(il, index_names, (*spec.tokens, spec.choice), 1).astype(jnp.int32)
    k, experts = il.shape[index_names.index(spec.choice)], dims[spec.experts].size   # (choice is never split)
    held = experts // ctx.axes_size(ep)
    act = ACTIVATIONS[spec.activation]
    dropped = jnp.zeros((), jnp.float32)
    if strategy == "exchange":
        n = ctx.axes_size(ep)
        worst = rows.shape[0] * (min(k, held) if distinct else k)
        buffer = worst if factor is None else max(1, min(worst, math.ceil(rows.shape[0] * k / n * factor)))
        run = _kernel(ctx, kernel, kernels, act, n * buffer, held)
        ragged = exchange == "ragged" or (exchange is None and ctx.mesh.platform in C.RAGGED_PLATFORMS)
        out, over = exchange_rows(ctx, rows, chosen, buffer, k, experts, ep, run, spec, ragged)
        total = math.prod(dims[t].size for t in spec.tokens) * k
        dropped = over.astype(jnp.float32) / float(total)
    else:
        run = _kernel(ctx, kernel, kernels, act, rows.shape[0] * k, held)
        out = _grouped_local(ctx, rows, chosen, k, experts, ep, run)
    return out.reshape(*token_shape, k, out.shape[-1]), dropped


def ragged_dot(x, w, index, *, experts: str = "experts", choice: str | None = None, distinct: bool = False,
               kernel: str | None = None):
    """The grouped matmul: ``out[*tokens, choice, d_out] = x[*tokens, d_in] · w[index[*tokens,
    choice], d_in, d_out]``, dropless, under every layout (:func:`expert_ffn` with one kernel)."""
    return expert_ffn(x, index, [w], experts=experts, choice=choice, activation="identity", distinct=distinct,
                      kernel=kernel)


def _placed(ctx, spec, dims, x, index, kernels):
    """``(axes per dim, strategy)``: the tokens, hidden and output dims planned as for any op; the
    experts where the kernels hold them (else the layout's), on axes no other dim takes. Where
    the tokens are split there too, exchanging the rows (expert parallelism) or gathering the
    kernels is a decision point, as is a partial sum against the gather where they are not."""
    others = Shape(d for d in dims if d.name != spec.experts)
    axes = dict(ctx.plan(others, [x, index, *kernels]))
    axes.update({spec.d_in: (), spec.choice: ()})
    if len(kernels) > 1:
        axes[spec.d_out] = ()
    held = {ctx.placement(w).of(w.dims, spec.experts) for w in kernels} if ctx.explicit else {()}
    ep = held.pop() if len(held) == 1 else ctx.layout_axes(spec.experts)   # (global arrays: whole)
    taken = {a for n in (spec.hidden, spec.d_out) for a in axes.get(n, ())}
    ep = () if set(ep) & taken else ep
    tokens = {a for n in spec.tokens for a in axes[n]}
    strategy = "local" if not ep else ("exchange" if set(ep) <= tokens else "partial")
    if strategy != "local" and decided(ctx, [strategy, "local"]) == "local":
        strategy, ep = "local", ()
    if strategy == "partial":   # tokens split on some axes of the experts' split: gathered there
        axes.update({n: tuple(a for a in axes[n] if a not in ep) for n in spec.tokens})
    axes[spec.experts] = ep
    return axes, strategy


class _Spec:
    def __init__(self, **kw):
        self.__dict__.update(kw)


def _spec(ctx, x, index, kernels, experts, choice, activation):
    """The op's dims by role, every name and size checked."""
    if not 1 <= len(kernels) <= 3:
        raise ShapeError(f"{where_(ctx)}: kernels must be one, two or three [experts, d_in, d_out] "
                         f"tensors, got {len(kernels)}")
    if activation not in ACTIVATIONS:
        raise ShapeError(f"{where_(ctx)}: activation must be one of {sorted(ACTIVATIONS)}, got "
                         f"{activation!r}{suggest(str(activation), ACTIVATIONS)}")
    if not jnp.issubdtype(index.dtype, jnp.integer):
        raise ShapeError(f"{where_(ctx)}: index [{index.dims}] must be integers (expert numbers), got {index.dtype}")
    for i, w in enumerate(kernels):
        if experts not in w.names or w.ndim != 3:
            raise ShapeError(f"{where_(ctx)}: kernel {i + 1} [{w.dims}] must be [{experts}, d_in, d_out]"
                             f"{suggest(experts, w.names)}; pass experts= the kernels' expert dim")
    own = [n for n in index.names if n not in x.names]
    choice = choice or (own[0] if len(own) == 1 else None)
    if choice is None or choice not in index.names or choice in x.names:
        raise ShapeError(f"{where_(ctx)}: cannot tell the choice dim of index [{index.dims}] (its one dim x "
                         f"[{x.dims}] lacks); pass choice=")
    tokens = tuple(n for n in index.names if n != choice)
    d_in = [n for n in x.names if n not in tokens]
    first = kernels[0]
    if len(d_in) != 1 or d_in[0] not in first.names or set(tokens) - set(x.names):
        raise ShapeError(f"{where_(ctx)}: x [{x.dims}] must be index's token dims {list(tokens)} and one "
                         f"feature dim that kernel 1 [{first.dims}] contracts")
    d_in = d_in[0]
    hidden = next(n for n in first.names if n not in (experts, d_in))
    if len(kernels) == 3 and set(kernels[1].names) != set(first.names):
        raise ShapeError(f"{where_(ctx)}: the gate and up kernels [{first.dims}] and [{kernels[1].dims}] "
                         "must have the same dims")
    last = kernels[-1]
    if len(kernels) > 1 and hidden not in last.names:
        raise ShapeError(f"{where_(ctx)}: the last kernel [{last.dims}] must contract the hidden dim "
                         f"{hidden!r} of [{first.dims}]")
    d_out = hidden if len(kernels) == 1 else next(n for n in last.names if n not in (experts, hidden))
    if d_out in tokens or d_out == choice:
        raise ShapeError(f"{where_(ctx)}: the output dim {d_out!r} is also a dim of index [{index.dims}]")
    roles = [(experts, d_in, hidden)] * (len(kernels) - 1) + [(experts, hidden, d_out)] if len(kernels) > 1 \
        else [(experts, d_in, d_out)]
    return _Spec(tokens=tokens, choice=choice, d_in=d_in, hidden=hidden, d_out=d_out, activation=activation,
                 experts=experts, roles=roles)


def _flat(local, names, order, ndim: int):
    """A local block with its dims in ``order``, the leading ones merged (``ndim`` axes left)."""
    block = jnp.transpose(local, [names.index(n) for n in order])
    return block.reshape(-1, *block.shape[len(order) - ndim + 1:])


def _ordered(local, names, roles):
    """A kernel's local block as ``[experts, d_in, d_out]`` (``roles``: those names)."""
    order = [names.index(n) for n in roles]
    return local if order == list(range(len(order))) else jnp.transpose(local, order)


def _kernel(ctx, kernel, kernels, act, rows: int, groups: int):
    """``run(rows sorted by group, group sizes)``: the local grouped matmul ``kernel``, or the
    one a decision point takes (fewer FLOPs first: the expander's ``groups * rows`` against the
    tiles' ``rows + groups * block``)."""
    if kernel is None:
        tiles = rows + groups * grouped.tile_rows(rows, groups)
        kernel = decided(ctx, list(grouped.KERNELS) if groups * rows <= tiles else list(reversed(grouped.KERNELS)))
    make = grouped.ragged if kernel == "ragged" else grouped.tiled
    return lambda x, sizes: make(x, sizes, kernels, act)


def _inverse(order):
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def _grouped_local(ctx, rows, chosen, k, experts, ep, run):
    """``[tokens * k, d_out]``: every assignment whose expert is on this device (all, ``ep``
    empty) run through it; the others zero."""
    held = experts // ctx.axes_size(ep) if ep else experts
    local = chosen - (C.axis_index(ep) * held if ep else 0)
    key = jnp.where((local >= 0) & (local < held), local, held)     # not here: after every group
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=held + 1)[:held].astype(jnp.int32)
    out = run(rows[order // k], sizes)
    return out[_inverse(order)]


def exchange_rows(ctx, rows, chosen, buffer, k, experts, ep, run, spec, ragged=False):
    """Expert parallelism: ``rows`` ``[tokens, d]`` and their ``k`` choices each (``chosen``
    ``[tokens * k]``) go to the devices of ``ep`` holding the experts, run there (``run(rows
    sorted by local expert, group sizes)``), and come back. Each destination's buffer holds
    ``buffer`` rows; assignments past it (only where it is smaller than the most a device can
    send) get zeros. ``ragged``: each way only the rows
    (:func:`meshdsl.rewrite.collectives.ragged_all_to_all`), else the whole buffer. Returns
    ``([tokens * k, d_out], how many assignments did not fit)``."""
    n = ctx.axes_size(ep)
    held = experts // n
    valid = (chosen >= 0) & (chosen < experts)
    chosen = jnp.where(valid, chosen, experts)              # sent nowhere: zeros
    order = jnp.argsort(chosen, stable=True)                # by destination, then local expert
    dest = jnp.minimum(chosen[order] // held, n - 1)
    counts = jnp.bincount(chosen, length=experts).astype(jnp.int32).reshape(n, held)
    per_dest = counts.sum(1)
    starts = jnp.cumsum(per_dest) - per_dest
    slot = jnp.arange(chosen.shape[0], dtype=jnp.int32) - starts[dest]
    fits = valid[order] & (slot < buffer)
    sent = jnp.diff(jnp.minimum(jnp.cumsum(counts, axis=1), buffer), axis=1, prepend=0)   # per local expert
    where = jnp.clip(starts[:, None] + jnp.arange(buffer, dtype=jnp.int32)[None, :], 0, chosen.shape[0] - 1)
    filled = jnp.arange(buffer)[None, :] < per_dest[:, None]
    send = jnp.where(filled[..., None], rows[order[where] // k], jnp.zeros((), rows.dtype))   # [n, buffer, d]
    tensor = f"[{' '.join(spec.tokens)} {spec.choice}] rows sent to their experts"
    got_counts = C.all_to_all(ctx, sent, ep, 0, 0, "rows per expert")     # [source, held]
    go, back_sizes = (sent.sum(1), got_counts.sum(1)) if ragged else (None, None)

    def move(v, name, sizes):                                               # [peer, buffer, d] each way
        if not ragged:
            return C.all_to_all(ctx, v, ep, 0, 0, name)
        return C.ragged_all_to_all(ctx, v.reshape(n * buffer, -1), ep, *sizes, name).reshape(v.shape)

    got = move(send, tensor, (go, back_sizes))                              # [source, buffer, d]
    ends = jnp.cumsum(got_counts, axis=1)                                   # per source, by local expert
    position = jnp.arange(buffer, dtype=jnp.int32)
    expert = jnp.sum(position[None, :, None] >= ends[:, None, :], axis=-1)  # [source, buffer]; held: padding
    back = jnp.argsort(expert.reshape(-1), stable=True)
    out = run(got.reshape(n * buffer, -1)[back], got_counts.sum(0))
    out = out[_inverse(back)].reshape(n, buffer, -1)
    returned = move(out, tensor.replace("sent to", "back from"), (back_sizes, go))   # [destination, ...]
    mine = jnp.where(fits[:, None], returned[dest, jnp.clip(slot, 0, buffer - 1)], jnp.zeros((), returned.dtype))
    return mine[_inverse(order)], jnp.sum(jnp.maximum(per_dest - buffer, 0))
