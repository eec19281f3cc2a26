"""Incremental decoding for decoder-only models (Llama): prefill the prompt, then one position per step.

    state, logits = prefill(model, ids, cache_length, mask=None)    # the prompt's K/V in the cache
    logits, state = decode_logits(model, state, token, slot)        # one position, cache updated

``prefill`` runs the prompt ``[batch, length]`` through the stack once (causal), keeps every
layer's rotated keys and values (the scan's outputs ``[layers, batch, kv_seq, kv_heads,
d_head]``), pads them with empty slots into a cache ``[layers, batch, kv_length, kv_heads,
d_head]`` of ``cache_length`` slots and returns the logits of the prompt's last position (the
first new token). ``decode_logits`` embeds the new tokens ``[batch]`` at cache slot ``slot`` (a traced int),
runs the stack with ``md.scan`` over ``layers`` (the caches ride along as scanned inputs and come
back as outputs), writes each layer's keys and values at ``slot`` and attends over the whole
cache, the slots after ``slot`` masked by ``md.attention``'s positions. Shapes never depend on
``slot``: one compiled step serves every position.

Left-padded prompts: ``mask`` ``[batch, length]`` is true for real tokens. Positions then count
real tokens only (Hugging Face's ``cumsum(mask) - 1``), padded keys are masked in every step, and
a pad query sees at least itself (so no row of the softmax is empty).

Layouts place the cache by its dim names: ``batch``, ``kv_heads`` (Megatron), ``kv_length`` (a
split cache: each device writes only its block).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md
from meshdsl.layers.gqa import KV_LENGTH, KV_SEQ, SEQ
from meshdsl.layers.stack import scan_layers

__all__ = ["prefill", "decode_logits", "DecodeState"]

DecodeState = dict   # {"cache": (k, v) [layers, batch, kv_length, kv_heads, d_head], "mask", "offset"}


def _prompt_mask(mask: md.NamedArray | None, n: int, total: int):
    """``(positions [batch, seq], attention mask [batch, kv_seq, seq], cache mask [batch,
    kv_length], offset [batch])`` for a left-padded prompt of ``n`` tokens (all None without)."""
    if mask is None:
        return None, None, None, None
    real = md.rename(mask if mask.dtype == jnp.bool_ else md.not_equal(mask, 0), {"length": SEQ})
    count = real.astype(jnp.int32)
    positions = md.maximum(md.cumsum(count, SEQ) - 1, 0)
    keys = md.rename(real, {SEQ: KV_SEQ})
    itself = md.equal(md.arange(md.Dim(KV_SEQ, n)), md.arange(md.Dim(SEQ, n)))
    attend = md.logical_or(keys, itself)
    offset = n - md.sum(count, SEQ)                                            # pads before each row's prompt
    cache_mask = md.arange(md.Dim(KV_LENGTH, total)) >= offset                 # left padding: the first slots
    return positions, attend, cache_mask, offset


def prefill(model, ids: md.NamedArray, cache_length: int, *, mask: md.NamedArray | None = None,
            cache_dtype=None):
    """``(state, logits)``: the prompt ``ids`` ``[batch, length]``'s keys and values in a cache of
    ``cache_length`` slots, and the float32 logits ``[batch, vocab]`` of its last position."""
    n = ids.dims["length"].size
    if cache_length < n:
        raise md.ShapeError(f"prefill: a cache of {cache_length} slots cannot hold a prompt of {n} tokens")
    positions, attend, cache_mask, offset = _prompt_mask(mask, n, cache_length)
    x = model.embed(ids)                                                         # [batch, length, d_model]
    angles = model.angles(md.Dim(SEQ, n), positions)

    def step(layer, x, _):
        return layer(x, angles, attend, keys_values=True)

    x, (k, v) = scan_layers(model.layers, x, step)
    dtype = cache_dtype or model.dtype
    # the prompt's slots, then empty ones: padded while the positions are kv_seq, so that the cache
    # dim kv_length only ever has its full size (a layout may split it)
    cache = tuple(md.rename(md.pad(t.astype(dtype), KV_SEQ, 0, cache_length - n), {KV_SEQ: KV_LENGTH})
                  for t in (k, v))
    last = md.take(x, n - 1, "length")                                           # [batch, d_model]
    logits = model.logits(last).astype(jnp.float32)
    return {"cache": cache, "mask": cache_mask, "offset": offset}, logits


def decode_logits(model, state: DecodeState, token: md.NamedArray, slot):
    """Logits ``[batch, vocab]`` (float32) of the tokens ``[batch]`` at cache slot ``slot`` (a
    traced int32) and the state with their keys and values written in."""
    one = md.Dim(SEQ, 1)
    ids = md.reshape(token, [*token.dims, one])
    x = model.embed(ids)                                                         # [batch, seq:1, d_model]
    position = md.arange(one) + slot
    if state["offset"] is not None:
        position = position - state["offset"]                                    # [batch, seq:1]
    angles = model.angles(one, position)
    graphdef, layers = nnx.split(model.layers)

    def step(x, xs):
        layer_state, (cache_k, cache_v) = xs
        x, cache_k, cache_v = nnx.merge(graphdef, layer_state).decode(x, angles, cache_k, cache_v, slot,
                                                                      mask=state["mask"])
        return x, (cache_k, cache_v)

    x, cache = md.scan(step, x, (layers, state["cache"]), dim="layers")
    logits = md.sum(model.logits(x).astype(jnp.float32), SEQ)                 # drop seq:1 (local, exact)
    return logits, {**state, "cache": cache}
