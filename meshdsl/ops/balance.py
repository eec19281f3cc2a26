"""Causal work per device: the tiles blockwise attention computes for given positions, and the
zigzag order of a sequence that gives every device of a context-parallel ring the same work.

With the sequence split in ``n`` contiguous chunks, causal attention gives the device holding the
last chunk ``n`` chunks of keys to attend to and the first one; in zigzag order (the sequence in
``2n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i``) each holds as many early as
late queries. Apply the order once to the data (tokens and targets) and pass it as the positions
(``md.attention(..., q_positions=order, kv_positions=order)``, rotary angles of the same).
"""

from __future__ import annotations

import numpy as np

from .flash import block_size

__all__ = ["tiles", "zigzag_positions"]


def tiles(spec, q_positions, kv_positions, block=None, q_block=None) -> int:
    """Tiles (query block x key block) computed for concrete positions: all of them, or with a
    causal mask those where some key is not after some query."""
    q_positions, kv_positions = np.asarray(q_positions), np.asarray(kv_positions)
    qb = block_size(len(q_positions), q_block)
    kb = block_size(len(kv_positions), block)
    if not spec.causal:
        return (len(q_positions) // qb) * (len(kv_positions) // kb)
    q_max = q_positions.reshape(-1, qb).max(1)
    k_min = kv_positions.reshape(-1, kb).min(1)
    return int((k_min[None, :] <= q_max[:, None]).sum())


def zigzag_positions(size: int, n: int) -> np.ndarray:
    """The zigzag (dual-chunk-swap) order of ``size`` positions for ``n`` devices: the sequence in
    ``2n`` chunks, device ``i`` holding chunks ``i`` and ``2n - 1 - i``, so each holds as many
    early as late queries and causal attention gives every device the same work."""
    if size % (2 * n):
        raise ValueError(f"zigzag order needs a length divisible by 2 x {n} devices, got {size}")
    chunks = np.arange(size).reshape(2 * n, size // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])
