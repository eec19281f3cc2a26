"""``md.attention``: blockwise online-softmax attention as one op, with context parallelism.

    out[stats, v features] = softmax over ``over`` of (scale * q · k + bias, masked) · v

``stats`` are q's dims less the ``features`` q and k contract (batch, heads, the query ``length``;
a dim of q that k and v lack, ``groups``, is grouped-query attention by broadcasting). The local
computation is :mod:`meshdsl.ops.flash`: keys in blocks, no ``[length, over]`` logits held, a
hand-written backward that recomputes them.

Where it computes, per mesh axis ``a`` (the op's strategies, :data:`STRATEGIES`):

* ``over`` whole (split or not elsewhere): local - no communication;
* ``over`` split on ``a``, the queries not (a cache split along its positions): ``partial`` - each
  device attends to its keys, then one ``pmax`` and two ``psum`` of the statistics and the
  weighted values (flash-decoding), never a gather of the keys;
* ``over`` split on ``a`` *and* the queries' ``length`` on ``a`` (context parallelism), one of:
  ``gather`` - keys and values all-gathered (their gradients reduce-scattered; the gathered copies
  are kept for the backward pass: ``|K| + |V|`` whole per device); ``ring`` - keys and values
  rotate by ``ppermute`` around ``a``, the running max and sum carried, no device ever holding more
  than one chunk (forward ``2 (n-1) |K_loc|``, backward ``4 (n-1) |K_loc|``: k, v, dk, dv);
  ``ulysses`` - one all-to-all each of q, k, v moves the split from the positions to a head dim
  (divisible by ``n``), attention runs local, the result leaves split by heads.

Where the layout splits the features q and k contract, they are gathered; or (a decision point
too) the logits are computed whole in named ops, their partial sums reduced once
(:mod:`meshdsl.ops.attention_dense`): fewer bytes for short sequences of long features.

Which of ``gather``, ``ring`` and ``ulysses`` is a decision point of the planner
(:mod:`meshdsl.planner`), priced by the bytes each emits; ``md.lower(..., attention=...)`` forces
one. Causal masks and the bias are computed from *global* positions on every block, so a
permuted sequence (zigzag order for causal balance) is attention over its ``q_positions`` and
``kv_positions``.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from . import flash
from ..names.errors import LayoutError, ShapeError, suggest
from ..names.named import NamedArray, is_named
from .attention_bias import bias_names, is_bias_fn, with_tile_bias
from .attention_dense import dense_attention
from .attention_local import local_attention
from .attention_ring import ring_attention
from .common import as_named, names_in, union_dims, where_
from .registry import op

__all__ = ["attention", "STRATEGIES"]

STRATEGIES = ("gather", "ring", "ulysses")   # context parallelism's candidates, in decision order
IMPLEMENTATIONS = ("flash", "cudnn", "xla")  # the local kernel: meshdsl.ops.flash, jax.nn.dot_product_attention


@op("attention")
def attention(ctx, q, k, v, *, over="kv_length", length=None, features=None, bias=None, mask=None,
              causal: bool = False, q_positions=None, kv_positions=None, scale=None, block=None,
              implementation: str | None = None) -> NamedArray:
    """Attention of queries ``q`` to keys ``k`` and values ``v`` along ``over``.

    ``features``: the dims q · k contracts (default: k's last dim other than ``over``);
    ``length``: q's position dim (default: q's one dim that k lacks, other than a grouped-query
    dim). ``bias``: added to the logits, over dims of q (less features) and ``over``: a
    NamedArray, or ``(fn, table)`` computing it on every block from the block's global positions,
    ``fn(table, q_positions, kv_positions)`` in named ops (:mod:`meshdsl.ops.attention_bias`:
    no ``[length, over]`` bias held; ``table`` gets its gradient); ``mask``:
    boolean, True where a query may see a key, over the same dims; ``causal``: keys at positions
    after the query's are masked, positions ``q_positions`` (over ``length``) and ``kv_positions``
    (over ``over``), default ``0 .. n-1``. ``scale``: default ``1 / sqrt(features' size)``.
    ``block``: keys per block (default 512). ``implementation``: ``"flash"`` (blockwise, here),
    ``"cudnn"`` or ``"xla"`` (``jax.nn.dot_product_attention``, where the keys are whole on each
    device); default: cuDNN's fused kernel on a GPU for 16-bit inputs, else flash. Returns q's
    dims, features replaced by v's.
    """
    q, k, v = (as_named(ctx, x, role) for x, role in ((q, "q"), (k, "k"), (v, "v")))
    computed = bias if is_bias_fn(bias) else None
    spec, dims = _spec(ctx, q, k, v, over, length, features, None if computed else bias, mask, causal, scale)
    bias = None if bias is None or computed else as_named(ctx, bias, "bias")
    mask = None if mask is None else as_named(ctx, mask, "mask")
    extras = [x for x in (bias, mask) if x is not None]
    if computed:
        spec = with_tile_bias(dataclasses.replace(
            spec, bias=bias_names(ctx, computed, q, k, spec.length, spec.over, spec.stats)), computed)
        extras += [x for x in jax.tree_util.tree_leaves(computed[1], is_leaf=is_named) if is_named(x)]
    pos = _positions(ctx, q_positions, kv_positions, q, k, spec)
    operands = [q, k, v, *extras, *[p for p in pos if isinstance(p, NamedArray)]]
    axes = ctx.plan(dims, operands, prefer=(spec.length,))
    if any(axes[f] for f in spec.features) and ctx.option(2):   # the logits' partial sums reduced
        return dense_attention(ctx, spec, dims, q, k, v, computed or bias, mask, pos)
    axes.update({f: () for f in spec.features})   # q . k sums the features whole: no partial logits
    held = ctx.placement(k).of(k.dims, spec.over) if ctx.explicit else ()
    if not axes[spec.length] and held and _query_split(ctx, spec, axes, q) == held:
        # queries and keys split alike along their positions, off the layout (which splits the
        # dims they were renamed from): they stay there, context parallelism's to serve
        axes = {**axes, spec.length: held, spec.over: ()}
    strategy, ring = _strategy(ctx, spec, dims, axes, held, q)
    axes = {**axes, spec.length: ring} if ring else axes
    bias = computed or bias
    if strategy == "ring":
        return ring_attention(ctx, spec, dims, axes, ring, q, k, v, bias, mask, pos, block)
    if strategy == "ulysses":
        axes = _ulysses_axes(spec, dims, axes, ring, ctx)
    impl = _implementation(ctx, implementation, q, k, v, spec)
    return local_attention(ctx, spec, dims, axes, q, k, v, bias, mask, pos, block, strategy, ring, impl)


def _spec(ctx, q, k, v, over, length, features, bias, mask, causal, scale):
    """The flash :class:`~meshdsl.ops.flash.Spec` of the operands, every name checked."""
    for x, role in ((k, "k"), (v, "v")):
        if over not in x.names:
            raise ShapeError(f"{where_(ctx)}: {role} [{x.dims}] has no dim {over!r} to attend over"
                             f"{suggest(over, x.names)}; pass over= the keys' position dim")
    feats = names_in(ctx, k, features, "features") if features is not None else \
        tuple(n for n in k.names if n != over)[-1:]
    for n in feats:
        if n not in q.names:
            raise ShapeError(f"{where_(ctx)}: q [{q.dims}] lacks the feature dim {n!r} that it contracts "
                             f"with k [{k.dims}]; pass features= the dims q and k share to multiply")
    if length is None:
        own = [n for n in q.names if n not in k.names and n not in feats]
        if len(own) != 1:
            raise ShapeError(f"{where_(ctx)}: cannot tell q's position dim among {own} of [{q.dims}]; "
                             "pass length= the queries' position dim")
        length = own[0]
    length = names_in(ctx, q, length, "length")[0]
    v_feats = tuple(n for n in v.names if n != over and n not in q.names or n in feats)
    out = tuple(n for n in q.names if n not in feats) + v_feats
    if len(set(out)) != len(out) or over in q.names or length in k.names or length in v.names:
        raise ShapeError(f"{where_(ctx)}: q [{q.dims}], k [{k.dims}], v [{v.dims}]: the queries' {length!r} "
                         f"and the keys' {over!r} must be different dims, each in its own operands")
    dims = union_dims(ctx, [q, k, v])
    stats = set(out) - set(v_feats) | {over}
    for x, role in ((bias, "bias"), (mask, "mask")):
        if x is not None:
            x = as_named(ctx, x, role)
            union_dims(ctx, [q, k, v, x])
            if not set(x.names) <= stats:
                raise ShapeError(f"{where_(ctx)}: {role} [{x.dims}] has dims {sorted(set(x.names) - stats)} "
                                 f"that the logits [{' '.join(n for n in out if n in stats)} {over}] lack")
    if mask is not None and as_named(ctx, mask).dtype != jnp.bool_:
        raise ShapeError(f"{where_(ctx)}: mask must be boolean (True: may attend), got {as_named(ctx, mask).dtype}")
    scale = 1.0 / math.sqrt(math.prod(k.dims[n].size for n in feats)) if scale is None else float(scale)
    return flash.Spec(q.names, k.names, v.names, out, length, over, feats, scale, bool(causal),
                      bias.names if bias is not None else None,
                      mask.names if mask is not None else None), dims


def _positions(ctx, q_positions, kv_positions, q, k, spec):
    """The given positions, each checked to lie along its dim: a NamedArray of integers, or
    numpy integers (constants: a fixed order such as zigzag, known to ``md.explain``); None:
    ``0 .. n-1``."""
    out = []
    for p, dim, role in ((q_positions, q.dims[spec.length], "q_positions"),
                         (kv_positions, k.dims[spec.over], "kv_positions")):
        if isinstance(p, (np.ndarray, list, tuple)):
            p = np.asarray(p)
            if p.shape != (dim.size,) or not np.issubdtype(p.dtype, np.integer):
                raise ShapeError(f"{where_(ctx)}: {role} must be {dim.size} integers (one per {dim.name}), "
                                 f"got {p.dtype} of shape {p.shape}")
        elif p is not None:
            p = as_named(ctx, p, role)
            if p.names != (dim.name,) or p.dims[dim.name].size != dim.size:
                raise ShapeError(f"{where_(ctx)}: {role} must be integers over [{dim}] alone, got [{p.dims}]")
        out.append(p)
    return out


def _strategy(ctx, spec, dims, axes, held, q):
    """``(strategy, ring axes)``: ``"local"``, ``"partial"`` (the keys split, the queries not), or
    context parallelism's ``gather``/``ring``/``ulysses`` over the axes splitting the queries'
    positions: the one forced by ``md.lower(attention=)`` (the keys split there first, a local
    slice if they arrive whole), else the planner's where the keys arrive split like the queries."""
    ring = axes[spec.length]
    forced = getattr(ctx, "attention", None)
    if forced and not ring:   # where the queries are split, or the layout splits them
        ring = _query_split(ctx, spec, axes, q)
    if forced and (not ring or axes[spec.over]):
        raise LayoutError(f"{where_(ctx)}: attention={forced!r} is forced but "
                          + (f"the keys' positions {spec.over!r} are split where the queries' are not"
                             if axes[spec.over] else
                             f"nothing splits the queries' positions {spec.length!r} (nor the dim they are "
                             f"renamed from)") + f" under layout {ctx.layout}; split {spec.length!r} over a "
                          f"mesh axis (context parallelism) or leave attention= unset")
    if forced:
        if forced == "ulysses" and not _ulysses_dims(spec, dims, axes, ring, ctx):
            raise ShapeError(f"{where_(ctx)}: attention='ulysses' needs a dim of q, k and v (a head dim) "
                             f"whose size divides by {ctx.axes_size(ring)} ({ctx.mesh.axes_text(ring)}), whole "
                             f"there; [{dims}] has none: use attention='ring' or 'gather'")
        return forced, ring
    if not held or axes[spec.over]:
        return ("partial" if axes[spec.over] else "local"), ()
    if ring != held:
        return "local", ()   # the keys gathered to where the queries are: the layout's choice
    choice = STRATEGIES[ctx.option(len(STRATEGIES))]
    if choice == "ulysses" and not _ulysses_dims(spec, dims, axes, held, ctx):
        return "gather", ring
    return choice, ring


def _implementation(ctx, implementation, q, k, v, spec) -> str:
    """The local kernel: the one asked for, else cuDNN's on a GPU for 16-bit q, k, v whose
    features agree in size (its constraints), else flash."""
    if implementation is not None:
        if implementation not in IMPLEMENTATIONS:
            raise ShapeError(f"{where_(ctx)}: implementation must be one of {IMPLEMENTATIONS}, got "
                             f"{implementation!r}{suggest(str(implementation), IMPLEMENTATIONS)}")
        return implementation
    platform = ctx.mesh.platform if ctx.mesh is not None else jax.default_backend()
    sixteen = all(x.dtype in (jnp.bfloat16, jnp.float16) for x in (q, k, v))
    same = [q.dims[f].size for f in spec.features] == [v.dims[n].size for n in spec.out if n not in spec.stats]
    return "cudnn" if platform == "gpu" and sixteen and same and not spec.bias else "flash"


def _query_split(ctx, spec, axes, q) -> tuple:
    """The axes splitting the queries' positions where ``q`` is, else where the layout puts them,
    if no other dim of the op (but the keys' positions) holds them."""
    if not ctx.explicit:
        return ()
    used = {a for n, ax in axes.items() if n not in (spec.length, spec.over) for a in ax}
    for want in (ctx.placement(q).of(q.dims, spec.length), ctx.layout_axes(spec.length)):
        if want and not used & set(want):
            return want
    return ()


def _ulysses_dims(spec, dims, axes, held, ctx) -> list:
    """Dims Ulysses may split instead of the positions: in q, k and v, not features, whole now,
    divisible by the axes' size."""
    n = ctx.axes_size(held)
    return [d for d in spec.k if d in spec.q and d in spec.v and d != spec.over and d not in spec.features
            and not axes[d] and dims[d].size % n == 0]


def _ulysses_axes(spec, dims, axes, held, ctx) -> dict:
    """Ulysses's placement: positions whole, the last eligible dim of k (a head dim) split where
    the positions were."""
    heads = _ulysses_dims(spec, dims, axes, held, ctx)[-1]
    return {**axes, spec.length: (), spec.over: (), heads: held}
