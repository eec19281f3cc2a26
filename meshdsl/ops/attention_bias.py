"""A bias computed on every block from its global positions: ``bias=(fn, table)``.

``fn(table, q_positions, kv_positions) -> NamedArray`` is written in named ops (T5's relative
position bias: buckets of ``kv_position - q_position`` looked up in ``table [buckets, heads]``).
``md.attention`` calls it for each tile with the tile's positions, on this device's blocks of
``table`` (its dims placed as the attention places them: ``heads`` split under Megatron), so no
``[length, kv_length]`` bias is ever held; the backward pass pulls each tile's gradient back to
``table`` (summed over the data axes where the table is replicated, as any parameter's).
"""

from __future__ import annotations

import dataclasses

import jax

from ..rewrite.contexts import GlobalContext
from ..names.dims import Dim, Shape
from ..names.errors import ShapeError
from ..names.named import NamedArray, is_named
from ..names.tracing import using
from .common import where_

__all__ = ["is_bias_fn", "bias_names", "with_tile_bias", "local_table", "named_operands"]


def is_bias_fn(bias) -> bool:
    return isinstance(bias, tuple) and len(bias) == 2 and callable(bias[0])


def named_operands(bias, mask) -> list:
    """The NamedArrays an attention reads besides q, k and v: the bias (or its function's
    table) and the mask."""
    if is_bias_fn(bias):
        return [x for x in jax.tree_util.tree_leaves(bias[1], is_leaf=is_named) if is_named(x)] + \
            ([mask] if mask is not None else [])
    return [x for x in (bias, mask) if x is not None]


def _named(arrays, templates):
    """NamedArrays of local ``arrays`` under the dim names of ``templates`` (sizes from the arrays)."""
    return [NamedArray(a, Shape(Dim(n, s) for n, s in zip(t.names, a.shape))) if is_named(t) else a
            for a, t in zip(arrays, templates)]


def _call(fn, templates, tree, arrays, q_positions, kv_positions, length: str, over: str, names=None):
    """``fn`` on plain ``arrays`` (the table's leaves, dim names from ``templates``), its named ops
    run as the unsharded program would (this device's blocks are the whole values here): its
    result transposed to ``names`` (default: its own), and its names."""
    with using(GlobalContext()):
        out = fn(jax.tree_util.tree_unflatten(tree, _named(arrays, templates)),
                 NamedArray(q_positions, Shape([Dim(length, q_positions.shape[0])])),
                 NamedArray(kv_positions, Shape([Dim(over, kv_positions.shape[0])])))
    order = names or out.names
    return jax.numpy.transpose(out.raw, [out.names.index(n) for n in order]), out.names


def bias_names(ctx, bias, q, k, length: str, over: str, stats) -> tuple:
    """The dims of ``fn``'s result, from a shape-only run on the global positions; a ShapeError
    if they are not dims of the logits."""
    fn, table = bias
    leaves, tree = jax.tree_util.tree_flatten(table, is_leaf=is_named)
    qp = jax.ShapeDtypeStruct((q.dims[length].size,), jax.numpy.int32)
    kp = jax.ShapeDtypeStruct((k.dims[over].size,), jax.numpy.int32)
    found = []

    def run(a, b):
        array, names = _call(fn, leaves, tree, [x.raw if is_named(x) else x for x in leaves], a, b, length, over)
        found.append(names)
        return array
    jax.eval_shape(run, qp, kp)
    names = tuple(found[0])
    extra = sorted(set(names) - set(stats) - {over})
    if extra:
        raise ShapeError(f"{where_(ctx)}: the bias function gives dims {list(names)}; {extra} are not dims of the "
                         f"logits [{' '.join(stats)} {over}]")
    return names


def local_table(ctx, table, axes, vary):
    """This device's blocks of the table's NamedArrays, their dims placed by ``axes``."""
    return jax.tree_util.tree_map(
        lambda x: ctx.local(x, {n: axes.get(n, ()) for n in x.names}, vary) if is_named(x) else x,
        table, is_leaf=is_named)


def with_tile_bias(spec, bias):
    """``spec`` with its ``bias_fn``: ``fn`` of a tile's positions on the local table."""
    fn, table = bias
    leaves, tree = jax.tree_util.tree_flatten(table, is_leaf=is_named)

    def tile(local, q_positions, kv_positions):
        return _call(fn, leaves, tree, jax.tree_util.tree_leaves(local), q_positions, kv_positions,
                     spec.length, spec.over, spec.bias)[0]

    return dataclasses.replace(spec, bias_fn=tile)
