"""T5 (v1.0, v1.1) and Switch/GShard MoE-T5, written entirely in meshdsl's named ops.

    model(encoder_ids, decoder_ids) -> logits [batch, length, vocab]

``encoder_ids`` and ``decoder_ids`` are integer NamedArrays ``[batch, <length>]`` (the length dims
may differ and have any name; the logits use the decoder's names). The same call runs unsharded
and inside ``md.lower(lambda m, e, d: m(e, d), mesh, layout)`` under any layout.

Structure (Hugging Face's T5ForConditionalGeneration, so weights import 1:1):

    x = dropout(shared[encoder_ids])
    L x  x = x + dropout(SelfAttention(RMSNorm(x), bias=encoder_bias))      (bidirectional)
         x = x + dropout(FFN(RMSNorm(x)))                                    (FFN or MoE)
    encoded = dropout(RMSNorm(x))
    y = dropout(shared[decoder_ids])
    L x  y = y + dropout(SelfAttention(RMSNorm(y), bias=decoder_bias))      (causal)
         y = y + dropout(CrossAttention(RMSNorm(y), encoded))
         y = y + dropout(FFN(RMSNorm(y)))
    logits = lm_head(dropout(RMSNorm(y)))      (v1.0: shared.attend(y * d_model**-0.5))
    logits[vocab >= config.vocab] = min        (the padding rows of the tables: never chosen)

The residual stream runs over ``[batch, length, d_model]``; each sub-layer renames ``length`` to
``seq`` on the way in and back on the way out. With no layout rule for ``length`` the renames are
free; ``length: model`` is Megatron sequence parallelism (norms and residuals split over the
sequence; one all-gather into each sub-layer, one reduce-scatter out), with no change to the model.
The embedding lookups and the logits work on the whole sequence too, so a split ``vocab`` and a
split ``length`` never meet in one tensor. Name the token dims of your data anything but
``length`` (the loss uses ``inputs`` and ``targets``).

Layers are stacked (parameters carry a ``layers`` dim) and run with ``md.scan``, one scanned step
per ``config.period`` layers (MoE-T5 alternates dense and sparse FFNs), so compile time does not
depend on depth. The relative position bias comes from one table per stack (T5's first layer owns
the table; the others reuse it), computed by ``md.attention`` on every block from the block's
global positions: no ``[heads, seq, kv_seq]`` bias is held, whatever the length.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

import meshdsl as md
from meshdsl.layers import (
    Attention, Dense, Embedding, FeedForward, MoE, RelativePositionBias, RMSNorm, dropout, scan_layers,
)
from meshdsl.layers.embedding import mask_padding
from meshdsl.layers.router import EXPERT_CHOICE

from .configs import T5Config

__all__ = ["T5", "count_params"]


class _Dims:
    def __init__(self, c: T5Config):
        self.d_model, self.d_ff = md.Dim("d_model", c.d_model), md.Dim("d_ff", c.d_ff)
        self.heads, self.d_kv = md.Dim("heads", c.heads), md.Dim("d_kv", c.d_kv)
        self.vocab = md.Dim("vocab", c.padded_vocab)      # the true vocabulary padded (config.vocab_multiple)
        self.experts = md.Dim("experts", max(c.num_experts, 1))
        self.expert_d_ff = md.Dim("d_ff", c.expert_d_ff or c.d_ff)


def _ffn(c: T5Config, dims: _Dims, sparse: bool, *, rngs, stack, dtype, param_dtype):
    if sparse:
        return MoE(dims.d_model, dims.expert_d_ff, dims.experts, rngs=rngs, top_k=c.top_k,
                   capacity_factor=c.capacity_factor, eval_capacity_factor=c.eval_capacity_factor,
                   expert_capacity=c.expert_capacity, group_size=c.group_size, jitter_noise=c.jitter_noise,
                   dropped=c.moe_dropped, activation=c.expert_activation, dropout_rate=c.dropout_rate, stack=stack, dtype=dtype,
                   param_dtype=param_dtype)
    return FeedForward(dims.d_model, dims.d_ff, rngs=rngs, activation=c.activation, dropout_rate=c.dropout_rate,
                       stack=stack, dtype=dtype, param_dtype=param_dtype)


def _keys(key, n):
    return [None] * n if key is None else list(jax.random.split(key, n))


class EncoderLayer(nnx.Module):
    """Self-attention and feed-forward (or MoE) sub-layers, each pre-normed and residual."""

    def __init__(self, c: T5Config, dims: _Dims, sparse: bool, *, rngs, stack, dtype, param_dtype):
        kw = dict(stack=stack, param_dtype=param_dtype)
        self.rate, self.sparse = c.dropout_rate, sparse
        self.attention_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.attention = Attention(dims.d_model, dims.heads, dims.d_kv, rngs=rngs, relative_bias=False,
                                   dropout_rate=c.dropout_rate, dtype=dtype, **kw)
        self.ffn_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.ffn = _ffn(c, dims, sparse, rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, x, bias, mask, key, train):
        k = _keys(key, 5)
        h, _ = self.attention(_enter(self.attention_norm(x)), bias=bias, key_mask=mask, key=k[0])
        x = x + dropout(_leave(h), self.rate, k[1])
        h, metrics = _run_ffn(self.ffn, _enter(self.ffn_norm(x)), k[2], train, self.sparse)
        return x + dropout(_leave(h), self.rate, k[3]), metrics


class DecoderLayer(nnx.Module):
    """Causal self-attention, cross-attention to the encoder, feed-forward (or MoE)."""

    def __init__(self, c: T5Config, dims: _Dims, sparse: bool, *, rngs, stack, dtype, param_dtype):
        kw = dict(stack=stack, param_dtype=param_dtype)
        self.rate, self.sparse = c.dropout_rate, sparse
        self.self_attention_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.self_attention = Attention(dims.d_model, dims.heads, dims.d_kv, rngs=rngs, causal=True,
                                        relative_bias=False, dropout_rate=c.dropout_rate, dtype=dtype, **kw)
        self.cross_attention_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.cross_attention = Attention(dims.d_model, dims.heads, dims.d_kv, rngs=rngs, relative_bias=False,
                                         dropout_rate=c.dropout_rate, dtype=dtype, **kw)
        self.ffn_norm = RMSNorm(dims.d_model, eps=c.eps, **kw)
        self.ffn = _ffn(c, dims, sparse, rngs=rngs, stack=stack, dtype=dtype, param_dtype=param_dtype)

    def __call__(self, y, context, bias, mask, key, train):
        k = _keys(key, 7)
        h, _ = self.self_attention(_enter(self.self_attention_norm(y)), bias=bias, key=k[0])
        y = y + dropout(_leave(h), self.rate, k[1])
        h, _ = self.cross_attention(_enter(self.cross_attention_norm(y)), context, key_mask=mask, key=k[2])
        y = y + dropout(_leave(h), self.rate, k[3])
        h, metrics = _run_ffn(self.ffn, _enter(self.ffn_norm(y)), k[4], train, self.sparse)
        return y + dropout(_leave(h), self.rate, k[5]), metrics


def _enter(x):
    """Into a sub-layer (and the embedding lookups and the logits): the residual stream's
    ``length`` becomes the whole sequence ``seq``. Under a sequence-parallel layout
    (``length: model``) this is where ``length`` is gathered."""
    return md.rename(x, {"length": "seq"})


def _leave(h):
    """Out of a sub-layer: back to ``length`` (a pending sum is reduce-scattered onto it)."""
    return md.rename(h, {"seq": "length"})


def _run_ffn(ffn, x, key, train, sparse):
    if sparse:   # metrics per token: a pipeline assembles them from its microbatches exactly
        return ffn(x, key=key, train=train, per_token=True)
    return ffn(x, key=key), {}


def _row_sums(v):
    """A router metric per token ``[batch, seq(, expert_choice)]`` summed over the row's tokens."""
    return md.sum(v, [d for d in v.names if d not in ("batch", EXPERT_CHOICE)])


def _per_layer(metrics):
    """The MoE metrics per token ``[layers, batch, seq(, expert_choice)]`` as their means per layer
    (``[layers]``, ``expert_load`` ``[layers, experts]``): taken after the scan."""
    def mean(v):
        v = md.mean(v, [d for d in v.names if d not in ("layers", EXPERT_CHOICE)])
        return md.rename(v, {EXPERT_CHOICE: "experts"}) if EXPERT_CHOICE in v.names else v
    return [{k: mean(v) for k, v in m.items()} for m in metrics]


class Stack(nnx.Module):
    """``layers / period`` scanned steps of ``period`` layers (dense, ..., sparse for MoE)."""

    def __init__(self, layer_cls, c: T5Config, dims: _Dims, n_layers: int, *, rngs, dtype, param_dtype):
        if n_layers % c.period:
            raise ValueError(f"{c.name}: {n_layers} layers is not a multiple of the MoE period {c.period}")
        stack = md.Dim("layers", n_layers // c.period)
        self.layers = nnx.List([
            layer_cls(c, dims, c.is_moe and i == c.period - 1, rngs=rngs, stack=stack, dtype=dtype,
                      param_dtype=param_dtype)
            for i in range(c.period)])

    def __call__(self, x, *args, key=None, train=False, remat="none", head=None, schedule=None):
        """``(x, metrics)``: the MoE metrics per sparse layer (:func:`_per_layer`). With ``head``,
        ``(head(x), metrics)``; a sparse stack then carries its router metrics as sums per row
        (:func:`_row_sums`) and calls ``head(x, router)`` with their sums over the stack's tokens:
        additive over rows, so a 1F1B pipeline's head takes them per microbatch (no ``ys`` to
        differentiate after the loop); ``metrics`` is then empty."""
        carried = head is not None and any(layer.sparse for layer in self.layers)

        def step(period, carry, layer_key):
            keys = _keys(layer_key, len(period.layers))
            x, sums = carry if carried else (carry, None)
            metrics = []
            for layer, k in zip(period.layers, keys):
                x, m = layer(x, *args, k, train)
                if carried and m:
                    sums = {name: sums[name] + _row_sums(v) for name, v in m.items()}
                    m = {}
                metrics.append(m)
            return ((x, sums) if carried else x), metrics

        if not carried:
            x, metrics = scan_layers(self, x, step, key=key, remat=remat, head=head, schedule=schedule)
            return x, _per_layer(metrics)
        tokens = x.dims["batch"].size * x.dims["length"].size
        zeros = {name: md.zeros(md.Shape([x.dims["batch"], *extra])) for name, extra in self._metric_dims().items()}

        def top(carry):
            y, sums = carry
            return head(y, {name: md.sum(v, "batch") / tokens for name, v in sums.items()})

        out, _ = scan_layers(self, (x, zeros), step, key=key, remat=remat, head=top, schedule=schedule)
        return out, []

    def _metric_dims(self) -> dict:
        """The dims besides ``batch`` of each router metric's sum per row."""
        sparse = next(layer for layer in self.layers if layer.sparse)
        experts = md.Dim(EXPERT_CHOICE, sparse.ffn.experts_dim.size)
        return {"load_balancing_loss": [], "router_z_loss": [], "dropped_fraction": [], "expert_load": [experts]}


class T5(nnx.Module):
    """Encoder-decoder T5 over named dims; see the module docstring."""

    def __init__(self, config: T5Config, *, rngs: nnx.Rngs, dtype=jnp.float32, param_dtype=jnp.float32):
        c = self.config = config
        dims = self.dims = _Dims(c)
        kw = dict(rngs=rngs, dtype=dtype, param_dtype=param_dtype)
        self.dtype = dtype
        self.shared = Embedding(dims.vocab, dims.d_model, **kw)
        self.encoder_bias = RelativePositionBias(dims.heads, rngs=rngs, num_buckets=c.num_buckets,
                                                 max_distance=c.max_distance, bidirectional=True,
                                                 scale=c.d_model ** -0.5, param_dtype=param_dtype)
        self.encoder = Stack(EncoderLayer, c, dims, c.encoder_layers, **kw)
        self.encoder_norm = RMSNorm(dims.d_model, eps=c.eps, param_dtype=param_dtype)
        self.decoder_bias = RelativePositionBias(dims.heads, rngs=rngs, num_buckets=c.num_buckets,
                                                 max_distance=c.max_distance, bidirectional=False,
                                                 scale=c.d_model ** -0.5, param_dtype=param_dtype)
        self.decoder = Stack(DecoderLayer, c, dims, c.decoder_layers, **kw)
        self.decoder_norm = RMSNorm(dims.d_model, eps=c.eps, param_dtype=param_dtype)
        self.lm_head = None if c.tie_embeddings else Dense(dims.d_model, dims.vocab, scale=c.d_model ** -0.5, **kw)

    def __call__(self, encoder_ids: md.NamedArray, decoder_ids: md.NamedArray, **kw) -> md.NamedArray:
        """Logits ``[batch, <decoder length>, vocab]``; see :meth:`forward` for the options."""
        return self.forward(encoder_ids, decoder_ids, **kw)[0]

    def forward(self, encoder_ids, decoder_ids, *, key=None, train=False, encoder_mask=None, remat="none",
                head=None):
        """``(logits, metrics)``. ``key``: dropout / jitter (None: deterministic). ``train``: MoE
        training capacity. ``encoder_mask``: ``[batch, <encoder length>]``, true for real tokens
        (None: attend to all, as Hugging Face without an attention mask). ``metrics``: per sparse
        layer ``(encoder, decoder)`` lists of the MoE metrics, each stacked along ``layers``.
        ``head``: a function of the logits returning a loss summed over the rows (or ``(loss,
        aux)``, see ``md.scan``), run as the decoder stack's head; then ``(head(logits), metrics)``:
        under a pipeline with ``schedule="1f1b"`` the loss is computed inside it, per microbatch.
        With sparse decoder layers it is ``head(logits, router)``: the decoder's router metrics
        summed over its sparse layers, each a mean over the batch's tokens (the decoder's metrics
        list is then empty)
        The encoder stack's pipeline is GPipe in any case (its output feeds the decoder)."""
        k = _keys(key, 4)
        enc_ids, _ = _as_tokens(encoder_ids, "encoder_ids")
        dec_ids, dec_len = _as_tokens(decoder_ids, "decoder_ids")
        mask = None if encoder_mask is None else md.rename(encoder_mask, {_length_name(encoder_mask): "kv_seq"})
        encoded, enc_metrics = self.encode(enc_ids, mask, key=k[0], train=train, remat=remat)
        context = md.rename(encoded, {"length": "kv_seq"})
        y = dropout(_leave(self.shared(_enter(dec_ids))), self.config.dropout_rate, k[1])
        bias = self.decoder_bias.blockwise()   # computed on every block of md.attention
        def logits(y):
            return md.rename(self.logits(y, key=k[3]), {"seq": dec_len})

        top = None if head is None else (lambda y, *router: head(logits(y), *router))
        y, dec_metrics = self.decoder(y, context, bias, mask, key=k[2], train=train, remat=remat, head=top)
        return (y if head is not None else logits(y)), (enc_metrics, dec_metrics)

    def logits(self, y: md.NamedArray, *, key=None) -> md.NamedArray:
        """``[..., d_model]`` (the decoder stack's output, before its final norm) -> ``[..., vocab]``,
        the padding rows of the vocabulary masked (:func:`~meshdsl.layers.embedding.mask_padding`).
        ``key``: the final dropout (None: none). The residual stream's ``length`` becomes ``seq``
        after the norm (:func:`_enter`)."""
        y = dropout(self.decoder_norm(y), self.config.dropout_rate, key)
        y = _enter(y) if "length" in y.names else y
        out = self.shared.attend(y * self.config.d_model ** -0.5) if self.lm_head is None else self.lm_head(y)
        return mask_padding(out, self.config.vocab)

    def encode(self, ids, mask=None, *, key=None, train=False, remat="none"):
        """Encoder output ``[batch, length, d_model]`` for token ids ``[batch, length]``; ``mask``
        ``[batch, kv_seq]`` marks the real tokens."""
        k = _keys(key, 3)
        x = dropout(_leave(self.shared(_enter(ids))), self.config.dropout_rate, k[0])
        bias = self.encoder_bias.blockwise()   # computed on every block of md.attention
        x, metrics = self.encoder(x, bias, mask, key=k[1], train=train, remat=remat, schedule="gpipe")
        return dropout(self.encoder_norm(x), self.config.dropout_rate, k[2]), metrics


def _length_name(ids: md.NamedArray) -> str:
    others = [n for n in ids.names if n != "batch"]
    if len(ids.names) != 2 or "batch" not in ids.names:
        raise md.ShapeError(f"T5 expects token ids [batch, <length>], got [{ids.dims}]")
    return others[0]


def _as_tokens(ids: md.NamedArray, what: str):
    if not isinstance(ids, md.NamedArray):
        raise md.ShapeError(f"T5: {what} must be a NamedArray [batch, length], got {type(ids).__name__}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise md.ShapeError(f"T5: {what} [{ids.dims}] must be integer token ids, got {ids.dtype}")
    name = _length_name(ids)
    ids = ids if name == "length" else md.rename(ids, {name: "length"})
    return md.transpose(ids, "batch length") if ids.names != ("batch", "length") else ids, name


def count_params(model_or_config) -> int:
    """Number of parameters (without materializing them when given a config)."""
    if isinstance(model_or_config, T5Config):
        model = nnx.eval_shape(lambda: T5(model_or_config, rngs=nnx.Rngs(0)))
    else:
        model = model_or_config
    leaves = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param),
                                       is_leaf=lambda x: isinstance(x, md.NamedArray))
    return sum(leaf.size if isinstance(leaf, md.NamedArray) else int(jnp.size(leaf)) for leaf in leaves)
