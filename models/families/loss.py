"""Training objective of the reference models, in named ops.

    loss = cross-entropy over real target tokens  (+ z_loss * logsumexp(logits)**2, T5X's)
         + load_balancing_coef * mean_l(load-balancing loss_l) + router_z_loss_coef * mean_l(z_l)   (MoE)

The MoE terms apply to MoE-T5 (:func:`t5_loss`) and to a MoE decoder (Mixtral, Qwen2-MoE:
:func:`lm_loss`, HF's ``router_aux_loss_coef`` as ``load_balancing_coef``); the metrics report
them as ``moe/load_balancing_loss``, ``moe/router_z_loss``, ``moe/expert_load`` (per expert) and
``moe/dropped_fraction``.

Decoder-only models (Llama) learn the next token: :func:`lm_loss` is the same cross-entropy of
the logits of ``decoder_input_tokens`` (the targets shifted right, start token 0) against
``decoder_target_tokens``, over packed windows of the token stream (:mod:`meshdsl.models.data.batches`).

Cross-entropy is ``logsumexp(logits) - logits[target]`` per token, averaged over tokens with weight
1 (padding has weight 0). Over a ``vocab`` split by the layout (Megatron) this costs two small
all-reduces of row statistics for ``logsumexp`` and one for the target logit, never a gather.

A padded vocabulary (the configs' ``vocab_multiple``): the models mask the padding rows' logits
to the dtype's most negative value, so ``logsumexp`` (the cross-entropy's and the z-loss's) and
the accuracy's argmax see the true vocabulary only, and the padding rows get no gradient.
"""

from __future__ import annotations

import jax.numpy as jnp

import meshdsl as md
from meshdsl.layers.router import EXPERT_CHOICE

__all__ = ["cross_entropy", "t5_loss", "lm_loss", "batch_arrays"]

ENCODER_TOKENS = "batch inputs"
DECODER_TOKENS = "batch targets"


def cross_entropy(logits: md.NamedArray, targets: md.NamedArray, weights: md.NamedArray | None = None,
                  z_loss: float = 0.0):
    """Mean cross-entropy (and T5X's z-loss) over tokens with weight > 0: ``(loss, metrics)``."""
    w = _weights(targets, weights)
    total = md.sum(w)
    loss, metrics = _token_terms(logits, targets, w, total, z_loss)
    return loss, {**metrics, "tokens": total}


def _weights(targets, weights):
    return md.ones(targets.dims) if weights is None else weights.astype(jnp.float32)


def _token_terms(logits, targets, w, total, z_loss):
    """The loss and its metrics as sums over the tokens (each over ``total``, the weight of the
    whole batch): additive over rows, so a pipeline may sum them over microbatches."""
    vocab = logits.dims["vocab"]
    logits = logits.astype(jnp.float32)
    lse = md.logsumexp(logits, "vocab")
    target_logit = md.sum(logits * md.one_hot(targets, vocab), "vocab")
    nll = lse - target_logit
    ce = md.sum(nll * w) / total
    z = md.sum(md.square(lse) * w) / total
    correct = md.equal(md.argmax(logits, "vocab"), targets).astype(jnp.float32)
    return ce + z_loss * z, {"loss": ce, "z_loss": z, "accuracy": md.sum(correct * w) / total}


def _sparse_layers(config) -> int:
    """Sparse layers in the model (the last of every ``period`` layers, both stacks)."""
    return (config.encoder_layers + config.decoder_layers) // config.period if config.is_moe else 0


def _moe_terms(model_metrics, n_sparse: int, router=None):
    """Each MoE metric summed over the sparse layers (per layer a mean over tokens; expert_load
    per expert) over ``n_sparse``: their mean. ``model_metrics``: per-layer metrics stacked along
    ``layers``; ``router``: sums over further sparse layers (the decoder's, from its head)."""
    out = {name: md.rename(v, {EXPERT_CHOICE: "experts"}) if EXPERT_CHOICE in v.names else v
           for name, v in (router or {}).items()}
    for m in (m for stack in model_metrics for m in stack if m):
        for name, v in m.items():
            v = md.sum(v, "layers")
            out[name] = out[name] + v if name in out else v
    return {name: v / n_sparse for name, v in out.items()}


def _router_loss(config, router) -> md.NamedArray:
    return config.load_balancing_coef * router["load_balancing_loss"] + \
        config.router_z_loss_coef * router["router_z_loss"]


def t5_loss(model, batch: dict, *, key=None, train: bool = True, remat: str = "none", mask_padding: bool = True):
    """Loss and metrics of a T5 / MoE-T5 ``model`` on a batch of NamedArrays (see
    :func:`batch_arrays`): ``encoder_input_tokens``, ``decoder_input_tokens``,
    ``decoder_target_tokens``, ``decoder_loss_weights``."""
    c = model.config
    enc = batch["encoder_input_tokens"]
    mask = md.not_equal(enc, 0) if mask_padding else None
    targets = batch["decoder_target_tokens"]
    w = _weights(targets, batch.get("decoder_loss_weights"))
    total = md.sum(w)
    n_sparse = _sparse_layers(c)

    def head(logits, router=None):
        # the loss is the decoder stack's head: inside the pipeline under schedule="1f1b"; the
        # decoder's router losses (sums per row, additive over microbatches) join it there
        loss, metrics = _token_terms(logits, targets, w, total, c.z_loss)
        if router:
            router = _moe_terms([], n_sparse, router)
            loss = loss + _router_loss(c, router)
            metrics.update({f"moe/{k}": v for k, v in router.items()})
        return loss, metrics

    (loss, metrics), moe = model.forward(enc, batch["decoder_input_tokens"], key=key, train=train,
                                         encoder_mask=mask, remat=remat, head=head)
    metrics = {**metrics, "tokens": total}
    router = _moe_terms(moe, n_sparse)
    if router:   # the encoder's router losses (per layer, from its scan)
        loss = loss + _router_loss(c, router)
        metrics.update({f"moe/{k}": metrics[f"moe/{k}"] + v if f"moe/{k}" in metrics else v
                        for k, v in router.items()})
    return loss, metrics


def lm_loss(model, batch: dict, *, key=None, train: bool = True, remat: str = "none"):
    """Loss and metrics of a decoder-only ``model`` (causal LM) on a batch of NamedArrays:
    ``decoder_input_tokens`` -> ``decoder_target_tokens`` (the next tokens), weighted by
    ``decoder_loss_weights`` (0 on padding). Other features (an encoder input) are ignored. The
    loss is the layer stack's head, so a 1F1B pipeline computes it per microbatch."""
    targets = batch["decoder_target_tokens"]
    w = _weights(targets, batch.get("decoder_loss_weights"))
    total = md.sum(w)

    def head(logits, router=None):
        # a MoE decoder's router metrics arrive as their means over the layers (per microbatch
        # under a pipeline, summed over them with the loss): HF Mixtral's aux loss, times its coef
        loss, metrics = _token_terms(logits, targets, w, total, model.config.z_loss)
        if router:
            router = _moe_terms([], 1, router)
            loss = loss + _router_loss(model.config, router)
            metrics.update({f"moe/{k}": v for k, v in router.items()})
        return loss, metrics

    loss, metrics = model.forward(batch["decoder_input_tokens"], key=key, train=train, remat=remat, head=head)
    return loss, {**metrics, "tokens": total}


def batch_arrays(batch: dict) -> dict:
    """The data pipeline's numpy batch as NamedArrays: ``[batch, inputs]`` for the encoder's
    tokens, ``[batch, targets]`` for the decoder's (distinct from the model's own ``length``,
    which a sequence-parallel layout splits)."""
    return {k: md.named(jnp.asarray(v), ENCODER_TOKENS if k.startswith("encoder") else DECODER_TOKENS)
            for k, v in batch.items()}
