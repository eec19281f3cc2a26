"""The local grouped matmul of :mod:`meshdsl.ops.experts`: rows sorted by group, each group's rows
through its own kernels. Two kernels, a decision point of the op priced by the step's time:

* ``ragged``: ``jax.lax.ragged_dot`` per kernel. Where the backend has a grouped GEMM it does
  the rows' work only; XLA's expander (XLA:CPU, and wherever no such kernel replaces it) runs
  every row against every group's matrix, masked: ``groups`` times the work, which the cost
  model counts (:func:`meshdsl.platform.jaxcompat.matmul_groups`).
* ``tiled``: the rows in tiles of ``block``, each tile within one group (a group's last tile
  padded), a loop over the tiles running the whole feed-forward chain on each: at most
  ``rows + groups * block`` rows of work whatever the group count (MegaBlocks' block-sparse
  grouping, as a loop). The tile body is rematerialised, so the backward pass keeps no per-tile
  copy of a kernel.

``chain(kernels, act)`` is the feed-forward both run: one kernel (``x · w``), two
(``act(x · w_in) · w_out``) or three (``(act(x · w_gate) * (x · w_up)) · w_out``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["KERNELS", "ragged", "tiled", "tile_rows", "chain"]

KERNELS = ("ragged", "tiled")


def chain(kernels, act, dot):
    """``x -> `` the feed-forward of ``kernels`` with matmul ``dot(h, w)``."""
    def run(x):
        if len(kernels) == 1:
            return dot(x, kernels[0])
        if len(kernels) == 2:
            return dot(act(dot(x, kernels[0])), kernels[1])
        return dot(act(dot(x, kernels[0])) * dot(x, kernels[1]), kernels[2])
    return run


def ragged(rows, sizes, kernels, act):
    """Rows ``[m, d]`` sorted by group (``sizes`` ``[groups]``, rows past their sum give zeros)
    through ``kernels`` ``[groups, d_in, d_out]`` by ``jax.lax.ragged_dot``."""
    return chain(kernels, act, lambda h, w: jax.lax.ragged_dot(h, w.astype(h.dtype), sizes))(rows)


def tile_rows(rows: int, groups: int) -> int:
    """The tile height: about half a group's share of the rows (a power of two, 8 .. 128), so the
    padding of the groups' last tiles stays near half the rows."""
    share = max(1, rows // (2 * groups))
    return max(8, min(128, 1 << (share.bit_length() - 1)))


def tiled(rows, sizes, kernels, act, block: int | None = None):
    """:func:`ragged`'s result, computed tile by tile (see the module docstring)."""
    m, d = rows.shape
    groups = sizes.shape[0]
    block = block or tile_rows(m, groups)
    count = -(-m // block) + groups                                     # enough tiles for any sizes
    per = (sizes + block - 1) // block                                  # tiles of each group
    group = jnp.repeat(jnp.arange(groups), per, total_repeat_length=count)
    used = jnp.arange(count) < per.sum()
    within = jnp.arange(count) - (jnp.cumsum(per) - per)[group]
    starts = jnp.cumsum(sizes) - sizes
    lo = starts[group] + within * block
    hi = jnp.where(used, jnp.minimum(lo + block, starts[group] + sizes[group]), lo)
    padded = jnp.concatenate([rows, jnp.zeros((block, d), rows.dtype)])
    kernels = [jnp.asarray(w) for w in kernels]

    @jax.checkpoint
    def tile(args):
        g, lo, hi = args
        keep = (lo + jnp.arange(block) < hi)[:, None]
        x = jnp.where(keep, jax.lax.dynamic_slice_in_dim(padded, lo, block), jnp.zeros((), rows.dtype))
        y = chain([w[g] for w in kernels], act, lambda h, w: h @ w.astype(h.dtype))(x)
        return jnp.where(keep, y, jnp.zeros((), y.dtype))

    ys = jax.lax.map(tile, (group, lo, hi))                             # [count, block, d_out]
    where = jnp.minimum(lo[:, None] + jnp.arange(block)[None, :], m + block - 1).reshape(-1)
    out = jnp.zeros((m + block, ys.shape[-1]), ys.dtype).at[where].add(ys.reshape(-1, ys.shape[-1]))
    return out[:m]
