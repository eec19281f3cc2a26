"""What ``md.explain`` shows of one ``md.attention``: its strategy, the bytes the strategy's
formula gives (per ring step, forward, backward), the memory it keeps per device, and the work
balance of causal attention across the devices sharing the sequence.

Formulas, per device and execution, ``n`` devices on the context axis, local sizes ``|x|``:

* ``ring``: each step sends the chunk of keys and values, ``|k| + |v|``; forward ``n - 1`` steps,
  backward ``2 (n - 1)`` (keys and values again, and their gradients' accumulators);
* ``gather``: keys and values all-gathered, ``(n-1)/n (|K| + |V|)`` of the whole, gradients
  reduce-scattered the same;
* ``ulysses``: all-to-alls of q, k, v and the result, ``(n-1)/n (|q| + |k| + |v| + |out|)``, and
  the same backward (the result's all-to-all is emitted by the op that reads it);
* ``partial``: all-reduces of the float32 result and the statistics (``2 (n-1)/n`` of each).

The work balance is ``max / mean`` over the devices of the tiles (a block of queries against a
block of keys) each computes, counted from the global positions where they are constants
(the default ``0 .. n-1``, or given from numpy: a zigzag order); with a causal mask a tile no
query sees is skipped (:func:`meshdsl.ops.balance.tiles`).

The fused kernel (:func:`kernel_cost`): the FLOPs and HBM bytes of one forward and one backward
pass of a fused attention kernel (FlashAttention, cuDNN's) over the device's queries and all the
keys it attends to: ``2 P (d_k + d_v)`` forward and ``2 P (3 d_k + 2 d_v)`` backward (the logits
recomputed, ``dv``, ``dp``, ``dq``, ``dk``) for ``P`` query-key pairs computed (with a causal mask,
those of the 128 x 128 tiles some query sees, on the device with the most); bytes: q, k, v, the
output and its statistics read or written once forward, and q, k, v, the output, its gradient and
statistics read and dq, dk, dv written backward. The op's computation runs in the name scopes
``mdk<N>f`` / ``mdk<N>b`` (:func:`kernel`), which :mod:`meshdsl.costmodel.roofline` prices with these
numbers instead of op by op.
"""

from __future__ import annotations

import functools
import itertools
import math

import jax
import numpy as np

from ..costmodel import cost
from . import balance, flash
from ..platform.jaxcompat import pricing

__all__ = ["describe", "record", "kernel", "kernel_cost"]

KERNEL_TILE = 128   # query and key positions per tile of a fused kernel (FlashAttention-2/3, cuDNN)
_TAGS = itertools.count()


def record(ctx, *args) -> str:
    """Add the entry :func:`describe` gives to the trace's (``md.explain`` reads ``ctx.attentions``);
    nothing for a candidate the planner only prices, whose kernel's work is recorded all the same
    (:meth:`meshdsl.rewrite.recorder.Recorder.computed`). Returns the name scope of this
    attention's kernel (for :func:`kernel`)."""
    tag = f"mdk{next(_TAGS)}"
    work = kernel_cost(ctx, *args[:9])
    ctx.rec.computed(work["forward_flops"], work["forward_bytes"], work["backward_flops"], work["backward_bytes"])
    spec, _, strategy, ring, q, k, v, out_dtype, _, block = args
    ctx.rec.holds(*_memory(ctx, spec, strategy, ring, q, k, v, out_dtype, block)[1:])   # beyond operands and result
    if ctx.explicit and ctx.rec.sandbox is None and ctx.rec.tracing and not pricing():
        ctx.attentions.append({**describe(ctx, *args), "kernel": {"scope": tag, **work}})
    return tag


def kernel(scope: str, phase: str, fn):
    """``fn`` run inside the name scope of a fused kernel's ``phase`` (``"f"`` or ``"b"``)."""
    @functools.wraps(fn)
    def run(*args):
        with jax.named_scope(f"{scope}{phase}"):
            return fn(*args)
    return run


def kernel_cost(ctx, spec, dims, strategy, ring, q, k, v, out_dtype, pos=(None, None)) -> dict:
    """FLOPs and HBM bytes of the fused kernel's forward (``forward_flops``, ``forward_bytes``) and
    backward pass, from the local blocks ``q``, ``k``, ``v`` (for ``ring``, one chunk of keys: the
    kernel attends to all ``n``), and the matmuls' dtype."""
    n = ctx.axes_size(ring) if ring and strategy == "ring" else 1
    shapes = {**dict(zip(spec.q, q.shape)), **dict(zip(spec.v, v.shape))}
    lq, d_k = shapes[spec.length], math.prod(shapes[f] for f in spec.features)
    lk = dict(zip(spec.k, k.shape))[spec.over] * n
    stats = math.prod(q.shape) // (lq * d_k)
    d_v = _out_size(spec, q, v) // (stats * lq)
    pairs = stats * lq * lk * _visible(spec, dims, strategy, ctx.axes_size(ring) if ring else 1, pos)
    item = np.dtype(q.dtype).itemsize
    qb, kvb = math.prod(q.shape) * item, (math.prod(k.shape) + math.prod(v.shape)) * item * n
    ob, lse = stats * lq * d_v * np.dtype(out_dtype).itemsize, stats * lq * 4
    return {"dtype": np.dtype(q.dtype).name,
            "forward_flops": 2.0 * pairs * (d_k + d_v), "backward_flops": 2.0 * pairs * (3 * d_k + 2 * d_v),
            "forward_bytes": float(qb + kvb + ob + lse), "backward_bytes": float(2 * (qb + kvb) + 2 * ob + lse)}


def _visible(spec, dims, strategy, n, pos) -> float:
    """The fraction of query-key pairs a fused kernel computes on the busiest device: 1 without a
    causal mask, else that of its 128 x 128 tiles some query sees (from the global positions where
    they are constants; a half where they are not)."""
    if not spec.causal:
        return 1.0
    lq, lk = dims[spec.length].size, dims[spec.over].size
    qp, kp = _global(pos[0], lq), _global(pos[1], lk)
    if qp is None or kp is None:
        return 0.5
    q_blocks = np.split(qp, n) if strategy in ("ring", "gather") and n > 1 else [qp]
    qt, kt = flash.block_size(len(q_blocks[0]), KERNEL_TILE), flash.block_size(lk, KERNEL_TILE)
    work = max(balance.tiles(spec, qd, kp, KERNEL_TILE, KERNEL_TILE) for qd in q_blocks)
    return work / ((len(q_blocks[0]) // qt) * (lk // kt))


def _memory(ctx, spec, strategy, ring, q, k, v, out_dtype, block) -> tuple[dict, float, float]:
    """What the attention holds per device: ``{"kept", "working"}`` as explain lists it (its
    blocks, its saved statistics, its kernel's tiles, a ring's chunk in flight), and of those
    the bytes beyond its operands and result (kept, working): the gathered keys' other chunks,
    Ulysses' re-split blocks, the statistics, tiles and chunk. Against the liveness of the
    emitted programs (8192 positions over 4 devices, 4 heads): gather holds 8.3 MB more than the
    ring, this says 8.4; Ulysses 13.4 MB less than the ring, this says 2.1 (the order is kept)."""
    n = ctx.axes_size(ring) if ring else 1
    size = {name: _bytes(ctx, x) for name, x in (("q", q), ("k", k), ("v", v))}
    stats = math.prod(q.shape) // math.prod(q.shape[spec.q.index(f)] for f in spec.features)
    out_b = _out_size(spec, q, v) * np.dtype(out_dtype).itemsize
    step = size["k"] + size["v"] if strategy == "ring" else 0.0
    kept = size["q"] + size["k"] + size["v"] + out_b + 4 * stats
    tile = stats // q.shape[spec.q.index(spec.length)] * flash.block_size(q.shape[spec.q.index(spec.length)], block) \
        * flash.block_size(k.shape[spec.k.index(spec.over)], block) * 4 * 2
    working = tile + step   # a ring's next chunk of keys arrives while the kernel reads this one
    extra = 4 * stats + ((size["k"] + size["v"]) * (n - 1) / n if strategy == "gather" else
                         size["q"] + size["k"] + size["v"] + out_b if strategy == "ulysses" else 0.0)
    return {"kept": kept, "working": working}, extra, working


def describe(ctx, spec, dims, strategy, ring, q, k, v, out_dtype, pos, block) -> dict:
    """The explain entry of one attention, from the local blocks ``q``, ``k``, ``v`` it computes with
    (for ``gather``, the keys whole)."""
    n = ctx.axes_size(ring) if ring else 1
    size = {name: _bytes(ctx, x) for name, x in (("q", q), ("k", k), ("v", v))}
    stats = math.prod(q.shape) // math.prod(q.shape[spec.q.index(f)] for f in spec.features)
    out = _out_size(spec, q, v)
    out_b = out * np.dtype(out_dtype).itemsize
    step = forward = backward = 0.0
    if strategy == "ring":
        step = size["k"] + size["v"]
        forward, backward = (n - 1) * step, 2 * (n - 1) * step
    elif strategy == "gather":
        forward = backward = (n - 1) / n * (size["k"] + size["v"])
    elif strategy == "ulysses":
        forward = backward = (n - 1) / n * (size["q"] + size["k"] + size["v"] + out_b)
    elif strategy == "partial":
        forward = 2 * (n - 1) / n * (out * 4 + 2 * stats * 4)
    memory = _memory(ctx, spec, strategy, ring, q, k, v, out_dtype, block)[0]
    name, line = ctx.op or ("attention", "?")
    axes = list(ctx.mesh.collapse(ring)) if ring else []
    return {"op": f"{name} at {line}", "strategy": strategy, "axes": axes, "devices": n,
            "length": dims[spec.length].size, "kv_length": dims[spec.over].size, "causal": spec.causal,
            "bytes_per_step": step, "forward_bytes": forward, "backward_bytes": backward,
            "memory": memory, "count": ctx.rec.multiplier,
            "balance": _balance(ctx, spec, dims, strategy, n, pos, block)}


def _bytes(ctx, x) -> float:
    return cost.array_bytes(x.shape, x.dtype, ctx.mesh.platform if ctx.mesh is not None else "cpu")


def _out_size(spec, q, v) -> int:
    shapes = {**dict(zip(spec.q, q.shape)), **dict(zip(spec.v, v.shape))}
    return math.prod(shapes[name] for name in spec.out)


def _global(p, size):
    """Global positions as numpy (None: ``0 .. size-1``), or None if they are not constants."""
    if p is None:
        return np.arange(size)
    if isinstance(p, np.ndarray):
        return p
    try:
        return np.asarray(p.raw)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def _balance(ctx, spec, dims, strategy, n, pos, block) -> float | None:
    """``max / mean`` of the tiles each device on the context axis computes (1.0 where each holds
    all positions; None where the positions are not constants)."""
    if strategy not in ("ring", "gather") or n == 1:
        return 1.0
    qp, kp = _global(pos[0], dims[spec.length].size), _global(pos[1], dims[spec.over].size)
    if qp is None or kp is None:
        return None
    q_blocks, k_chunks = np.split(qp, n), np.split(kp, n)
    if strategy == "ring":
        work = [sum(balance.tiles(spec, qd, kc, block, block) for kc in k_chunks) for qd in q_blocks]
    else:
        work = [balance.tiles(spec, qd, kp, block, block) for qd in q_blocks]
    mean = sum(work) / len(work)
    return float(max(work) / mean) if mean else 1.0
