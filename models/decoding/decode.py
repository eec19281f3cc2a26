"""Incremental decoding for T5 / MoE-T5: run the encoder once, decode one position per step.

    state  = prefill(model, encoder_ids, max_length, extra=[beam])     # encoder + cross K/V + empty cache
    logits, cache = decode_logits(model, state, token, position)      # one position, cache updated

``prefill`` runs the encoder, computes every decoder layer's cross-attention keys and values
``[layers, batch, (beam,) kv_seq, heads, d_kv]`` once, and creates the self-attention KV cache
``[layers, batch, (beam,) kv_length, heads, d_kv]`` (zeros; ``kv_length`` = the longest decoder
sequence). ``decode_logits`` embeds the new tokens ``[batch, (beam)]``, runs the decoder stack
with ``md.scan`` over ``layers`` (the caches ride along as scanned inputs and come back as
outputs), writes each layer's new keys and values at ``position`` with
``md.dynamic_update_slice`` and attends over the whole cache with the positions after
``position`` masked. Shapes never depend on ``position``: one compiled step serves every position
and the cost per token is flat in the generated length.

Layouts place the cache by its dim names: ``batch`` (batch-split), ``heads`` (weight-stationary
heads), ``kv_length`` (a split cache: each device writes only its block, softmax statistics are
all-reduced). The training forward (:class:`~meshdsl.models.t5.T5`) is untouched; this module
reuses its parameters sub-layer by sub-layer.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

import meshdsl as md
from meshdsl.layers.attention import KV_LENGTH
from meshdsl.layers.position import relative_position_bucket
from meshdsl.layers.stack import scan_layers

__all__ = ["DecodeState", "prefill", "decode_logits", "encoder_mask_like_hf", "token_ids", "KV_LENGTH"]

DecodeState = dict   # {"cache": [(k, v)] per period slot, "cross": [(k, v)], "mask": NamedArray | None}


def encoder_mask_like_hf(ids: md.NamedArray, pad_id: int = 0):
    """Hugging Face's ``generate`` masks the encoder's pad tokens when the inputs contain any
    (``input_ids != pad``), else attends to all: the same rule, applied on the host."""
    import numpy as np
    if not bool(np.any(np.asarray(ids.array) == pad_id)):
        return None
    return md.not_equal(ids, pad_id)


def prefill(model, encoder_ids: md.NamedArray, max_length: int, *, mask: md.NamedArray | None = None,
            extra: tuple = (), cache_dtype=None) -> DecodeState:
    """Encode ``encoder_ids`` ``[batch, length]`` once; cross-attention K/V of every decoder layer;
    an empty self-attention cache for ``max_length`` decoder positions.

    ``extra``: more token dims after ``batch`` (beam search: ``(md.Dim("beam", n),)``); the encoder
    runs once per batch row and its keys and values are broadcast over them.
    """
    c = model.config
    ids = token_ids(encoder_ids)
    kv_mask = None if mask is None else md.rename(mask, {mask.names[-1]: "kv_seq"})
    encoded, _ = model.encode(ids, kv_mask)
    context = md.rename(encoded, {"length": "kv_seq"})
    batch = ids.dims["batch"]
    heads, d_kv = model.dims.heads, model.dims.d_kv
    dtype = cache_dtype or model.dtype

    def cross_kv(period, carry, _):
        out = []
        for layer in period.layers:
            k, v = layer.cross_attention.keys_values(context)
            out.append((_broadcast(k, extra), _broadcast(v, extra)))
        return carry, out

    _, cross = scan_layers(model.decoder, md.zeros([batch]), cross_kv)
    layers = md.Dim("layers", c.decoder_layers // c.period)
    cache_dims = [layers, batch, *extra, md.Dim(KV_LENGTH, max_length), heads, d_kv]
    cache = [(md.zeros(cache_dims, dtype), md.zeros(cache_dims, dtype)) for _ in range(c.period)]
    if kv_mask is not None:
        kv_mask = _broadcast(kv_mask, extra)
    return {"cache": cache, "cross": cross, "mask": kv_mask}


def _broadcast(x: md.NamedArray, extra) -> md.NamedArray:
    """``x`` ``[batch, rest...]`` repeated over the ``extra`` dims, placed right after ``batch``."""
    if not extra:
        return x
    y = x.astype(jnp.float32) * md.ones(list(extra)) if x.dtype == jnp.bool_ else x * md.ones(list(extra), x.dtype)
    order = [n for n in x.names[:x.names.index("batch") + 1]] + [d.name for d in extra] + \
        [n for n in x.names[x.names.index("batch") + 1:]]
    y = md.transpose(y, order)
    return md.not_equal(y, 0) if x.dtype == jnp.bool_ else y


def decoder_position_bias(model, kv_length: md.Dim, position) -> md.NamedArray:
    """Relative position bias ``[kv_length, heads]`` of the query at ``position`` (causal buckets,
    the decoder's table), as T5's training forward computes row ``position`` of it."""
    c, table = model.config, model.decoder_bias
    relative = md.arange(kv_length) - position                       # memory - query
    bucket = relative_position_bucket(relative, False, c.num_buckets, c.max_distance)
    return md.take(table.embedding.get_value(), bucket, "buckets")


def decode_logits(model, state: DecodeState, token: md.NamedArray, position):
    """Logits ``[*token.dims, vocab]`` (float32) for the tokens at ``position`` (a traced int32)
    and the cache with their keys and values written in. ``token``: ``[batch, (beam)]`` ids. The
    logits are the model's (:meth:`~meshdsl.models.t5.T5.logits`): a padded vocabulary's padding
    masked."""
    ids = md.reshape(token, [*token.dims, md.Dim("seq", 1)])
    y = model.shared(ids)                                            # [batch, (beam), seq:1, d_model]
    kv_length = state["cache"][0][0].dims[KV_LENGTH]
    bias = decoder_position_bias(model, kv_length, position)
    mask = state["mask"]
    graphdef, stack_state = nnx.split(model.decoder)

    def step(y, xs):
        layer_state, caches, crosses = xs
        period = nnx.merge(graphdef, layer_state)
        new = []
        for layer, (ck, cv), (xk, xv) in zip(period.layers, caches, crosses):
            h, ck, cv = layer.self_attention.decode(layer.self_attention_norm(y), ck, cv, position, bias=bias)
            y = y + h
            y = y + layer.cross_attention.decode_cross(layer.cross_attention_norm(y), xk, xv, key_mask=mask)
            x = layer.ffn_norm(y)
            h = layer.ffn(x, train=False)[0] if layer.sparse else layer.ffn(x)
            y = y + h
            new.append((ck, cv))
        return y, new

    y, cache = md.scan(step, y, (stack_state, state["cache"], state["cross"]), dim="layers")
    logits = md.sum(model.logits(y).astype(jnp.float32), "seq")      # drop seq:1 (local, exact)
    return logits, {**state, "cache": cache}


def token_ids(ids: md.NamedArray) -> md.NamedArray:
    if not isinstance(ids, md.NamedArray) or ids.ndim != 2 or "batch" not in ids.names:
        raise md.ShapeError(f"generate: inputs must be token ids [batch, length], got "
                            f"{getattr(ids, 'dims', type(ids).__name__)}")
    other = [n for n in ids.names if n != "batch"][0]
    ids = ids if other == "length" else md.rename(ids, {other: "length"})
    return ids if ids.names == ("batch", "length") else md.transpose(ids, "batch length")
