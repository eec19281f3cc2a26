"""Inference layouts (Pope et al. 2022, "Efficiently Scaling Transformer Inference") and the cost
of one decode step.

On a mesh ``data x model`` (names as in the training layouts):

* ``batch-split``: ``batch: data+model``, weights replicated: no communication, every device
  reads every weight for its share of the batch (good for large batches, weights that fit);
* ``1d-weight-stationary``: ``heads``/``d_ff``/``vocab`` on ``model`` (Megatron), ``batch`` on
  ``data``: weights stay put, one all-reduce of ``[batch, d_model]`` per sub-layer;
* ``2d-weight-stationary``: ``d_model`` on ``data`` and ``heads``/``d_ff`` on ``model``: every
  weight is split on both axes, activations move instead (scales to more chips at small batch);
  the cache, which has no ``d_model``, is split on ``data`` along ``kv_length`` (else it would be
  replicated over ``data`` and, written from a resolved partial sum, re-synchronised every step);
* ``weight-gathered``: ``batch: data+model``, parameters *stored* split (``params={d_model: ...}``)
  and all-gathered where used (prefill with large batches: moving weights is cheaper than moving
  activations);
* ``kv-split``: ``batch: data``, ``kv_length: model``: the cache split along its positions (long
  contexts); each device writes only its block, softmax statistics are all-reduced.

The KV cache ``[layers, batch, (beam), kv_length, heads, d_kv]`` is placed by the same rules
(``batch``, ``heads``, ``kv_length``). :func:`decode_step_cost` explains one decode step: bytes moved,
matmul flops and the bytes each device reads from memory per token (its parameters and its part
of the cache: the decode roofline's numerator).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

import meshdsl as md

from .decode import decode_logits, prefill

__all__ = ["INFERENCE_LAYOUTS", "inference_layout", "decode_step_cost", "bytes_per_device"]

INFERENCE_LAYOUTS = {
    "batch-split": md.Layout({"batch": ("data", "model")}),
    "1d-weight-stationary": md.Layout({"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}),
    "2d-weight-stationary": md.Layout({"d_model": "data", "heads": "model", "d_ff": "model", "vocab": "model",
                                       "kv_length": "data"}),
    "weight-gathered": md.Layout({"batch": ("data", "model")}, params={"d_model": ("data", "model")}),
    "kv-split": md.Layout({"batch": "data", "kv_length": "model"}),
}


def inference_layout(name: str) -> md.Layout:
    """One of :data:`INFERENCE_LAYOUTS` by name (``data x model`` mesh)."""
    if name not in INFERENCE_LAYOUTS:
        raise md.MeshDSLError(f"unknown inference layout {name!r}; choose one of {sorted(INFERENCE_LAYOUTS)}")
    return INFERENCE_LAYOUTS[name]


def bytes_per_device(tree, mesh: md.Mesh, layout: md.Layout) -> float:
    """Bytes of ``tree``'s NamedArrays one device holds (parameters by the storage rules)."""
    total = 0.0
    for leaf in jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, md.NamedArray)):
        if not isinstance(leaf, md.NamedArray):
            continue
        spec = layout.spec(leaf.dims, mesh, storage=leaf.is_param)
        split = math.prod(mesh.axes_size(entry if isinstance(entry, tuple) else (entry,))
                          for entry in spec if entry)
        total += math.prod(leaf.dims.sizes) * jnp.dtype(leaf.dtype).itemsize / split
    return total


def _abstract_step_inputs(model, batch: int, encoder_length: int, max_length: int):
    ids = md.named(jnp.zeros((batch, encoder_length), jnp.int32), "batch length")
    state = jax.eval_shape(lambda m, i: prefill(m, i, max_length), model, ids)
    token = md.named(jnp.zeros((batch,), jnp.int32), "batch")
    return state, token


def decode_step_cost(model, mesh: md.Mesh, layout: md.Layout, *, batch: int, encoder_length: int,
                     max_length: int, param_gather: str = "keep") -> dict:
    """``md.explain`` of one greedy decode step plus the decode roofline numbers per device.

    Returns ``{"report": md.Report, "bytes_moved": ..., "flops": ..., "param_bytes": ...,
    "cache_bytes": ..., "memory_read_per_token": param_bytes + cache_bytes (+ cross K/V),
    "collectives": {kind: {count, bytes}}}`` (bytes and flops per device and step; a step makes
    one token per batch row)."""
    state, token = _abstract_step_inputs(model, batch, encoder_length, max_length)

    def step(m, s, t, pos):
        logits, s = decode_logits(m, s, t, pos)
        return md.argmax(logits, "vocab"), s

    report = md.explain(step, mesh, layout, model, state, token, jnp.int32(0), param_gather=param_gather)
    from flax import nnx
    params = nnx.state(model, nnx.Param)
    param_bytes = bytes_per_device(params, mesh, layout)
    cache_bytes = bytes_per_device(state["cache"], mesh, layout)
    cross_bytes = bytes_per_device(state["cross"], mesh, layout)
    return {"report": report, "bytes_moved": report.total_bytes, "flops": report.flops,
            "param_bytes": param_bytes, "cache_bytes": cache_bytes, "cross_bytes": cross_bytes,
            "memory_read_per_token": param_bytes + cache_bytes + cross_bytes, "collectives": report.summary()}
