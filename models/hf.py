"""Weights from and to Hugging Face ``transformers``: T5 v1.0, v1.1 and SwitchTransformers.

    model = meshdsl.models.hf.load(hf_model)    # T5ForConditionalGeneration or
                                                # SwitchTransformersForConditionalGeneration
    state_dict = meshdsl.models.hf.export(model)  # {name: numpy array}, loadable by HF

The configuration is read from ``hf_model.config``. Each of our parameters maps to one HF tensor
(or one per expert), transposed and reshaped by name: HF's ``q.weight`` ``[heads*d_kv, d_model]``
is our ``q.kernel`` ``[d_model, heads, d_kv]``; HF block ``i`` is our stacked step ``i // period``,
slot ``i % period``. Nothing is downloaded: pass a model you built or loaded yourself.
"""

from __future__ import annotations

import re

import jax
import numpy as np
from flax import nnx

import meshdsl as md

from .configs import T5Config
from .t5 import T5

__all__ = ["load", "export", "config_from_hf"]


def config_from_hf(hf_config) -> T5Config:
    """Our :class:`T5Config` for a ``transformers`` T5Config or SwitchTransformersConfig."""
    c = hf_config
    switch = type(c).__name__.startswith("SwitchTransformers")
    common = dict(name=getattr(c, "_name_or_path", "") or type(c).__name__, d_model=c.d_model, d_ff=c.d_ff,
                  heads=c.num_heads, d_kv=c.d_kv, encoder_layers=c.num_layers,
                  decoder_layers=c.num_decoder_layers or c.num_layers, vocab=c.vocab_size,
                  tie_embeddings=bool(c.tie_word_embeddings), dropout_rate=c.dropout_rate,
                  num_buckets=c.relative_attention_num_buckets, max_distance=c.relative_attention_max_distance,
                  eps=c.layer_norm_epsilon)
    if not switch:
        act = c.feed_forward_proj
        if act not in ("relu", "gated-gelu"):
            raise ValueError(f"unsupported T5 feed_forward_proj {act!r} (relu or gated-gelu)")
        return T5Config(activation=act, **common)
    if c.encoder_sparse_step != c.decoder_sparse_step or c.encoder_sparse_step < 1:
        raise ValueError("Switch import needs encoder_sparse_step == decoder_sparse_step >= 1, got "
                         f"{c.encoder_sparse_step}, {c.decoder_sparse_step}")
    return T5Config(activation="relu", num_experts=c.num_experts, moe_every=c.encoder_sparse_step,
                    expert_d_ff=c.d_ff, expert_capacity=c.expert_capacity, jitter_noise=c.router_jitter_noise,
                    load_balancing_coef=c.router_aux_loss_coef, router_z_loss_coef=c.router_z_loss_coef,
                    moe_dropped="hf", **common)


# -- the name map ---------------------------------------------------------------------------------

_ATTN = {"attention": ("0", "SelfAttention"), "self_attention": ("0", "SelfAttention"),
         "cross_attention": ("1", "EncDecAttention")}
_NORM = {"attention_norm": "0", "self_attention_norm": "0", "cross_attention_norm": "1"}


def _hf_block_key(stack: str, sub: list, config: T5Config, switch: bool, hf_index: int) -> list[str]:
    """HF key(s) (without the block prefix) for our per-layer parameter path ``sub``."""
    ffn_layer = "1" if stack == "encoder" else "2"
    head = sub[0]
    if head in _ATTN:
        layer, name = _ATTN[head]
        return [f"layer.{layer}.{name}.{sub[1]}.weight"]
    if head in _NORM:
        return [f"layer.{_NORM[head]}.layer_norm.weight"]
    if head == "ffn_norm":
        return [f"layer.{ffn_layer}.layer_norm.weight"]
    assert head == "ffn", sub
    mlp = "mlp" if switch else "DenseReluDense"
    if sub[1] == "router":
        return [f"layer.{ffn_layer}.mlp.router.classifier.weight"]
    if sub[1] == "experts":
        return [f"layer.{ffn_layer}.mlp.experts.expert_{e}.{sub[2]}.weight" for e in range(config.num_experts)]
    return [f"layer.{ffn_layer}.{mlp}.{sub[1]}.weight"]


def _path_names(path) -> list[str]:
    return [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]


def _mapping(model: T5, switch: bool):
    """Yield (our path, NamedArray placeholder, [(hf key, layer index or None)]) for every parameter."""
    c = model.config
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, md.NamedArray))[0]
    for path, leaf in leaves:
        names = [n for n in _path_names(path) if n != "value"]
        top = names[0]
        if top == "shared":
            yield path, leaf, [("shared.weight", None)]
        elif top == "lm_head":
            yield path, leaf, [("lm_head.weight", None)]
        elif top in ("encoder_bias", "decoder_bias"):
            stack = top.split("_")[0]
            yield path, leaf, [(f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight", None)]
        elif top in ("encoder_norm", "decoder_norm"):
            yield path, leaf, [(f"{top.split('_')[0]}.final_layer_norm.weight", None)]
        else:  # encoder/layers/<slot>/<sub...>/kernel|scale
            stack, slot, sub = top, int(names[2]), names[3:-1]
            steps = leaf.dims["layers"].size
            keys = []
            for s in range(steps):
                i = s * c.period + slot
                keys.append([(f"{stack}.block.{i}.{k}", s) for k in _hf_block_key(stack, sub, c, switch, i)])
            yield path, leaf, keys


# -- tensor layout conversions --------------------------------------------------------------------

def _convert_in(hf: np.ndarray, key: str, heads: int) -> np.ndarray:
    if re.search(r"Attention\.[qkv]\.weight$", key):
        return hf.T.reshape(hf.shape[1], heads, -1)
    if re.search(r"Attention\.o\.weight$", key):
        return hf.reshape(hf.shape[0], heads, -1).transpose(1, 2, 0)
    if key.endswith(("layer_norm.weight", "relative_attention_bias.weight")) or key == "shared.weight":
        return hf
    return hf.T


def _convert_out(ours: np.ndarray, key: str) -> np.ndarray:
    if re.search(r"Attention\.[qkv]\.weight$", key):
        return ours.reshape(ours.shape[0], -1).T
    if re.search(r"Attention\.o\.weight$", key):
        return ours.reshape(-1, ours.shape[-1]).T
    if key.endswith(("layer_norm.weight", "relative_attention_bias.weight")) or key == "shared.weight":
        return ours
    return ours.T


def _is_switch(hf_model) -> bool:
    return type(hf_model.config).__name__.startswith("SwitchTransformers")


def load(hf_model, *, dtype=None) -> T5:
    """Our T5 / MoE-T5 with the weights of a ``transformers`` model (built or loaded offline)."""
    config = config_from_hf(hf_model.config)
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    abstract = nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    values = {}
    for path, leaf, keys in _mapping(abstract, _is_switch(hf_model)):
        if keys and isinstance(keys[0], tuple):
            arr = _convert_in(sd[keys[0][0]], keys[0][0], config.heads)
        else:  # per layer (and per expert): stack along layers (and experts)
            per_layer = []
            for layer_keys in keys:
                mats = [_convert_in(sd[k], k, config.heads) for k, _ in layer_keys]
                per_layer.append(np.stack(mats) if "experts" in leaf.names else mats[0])
            arr = np.stack(per_layer)
        if arr.shape != leaf.dims.sizes:
            raise ValueError(f"HF tensor for {'/'.join(_path_names(path))} has shape {arr.shape}, "
                             f"expected [{leaf.dims}]")
        values[tuple(_path_names(path))] = md.param(md.named(arr.astype(dtype or leaf.dtype), leaf.dims))

    def fill(path, leaf):
        if isinstance(leaf, md.NamedArray):
            return values[tuple(_path_names(path))]
        return leaf

    params = jax.tree_util.tree_map_with_path(fill, nnx.state(abstract, nnx.Param),
                                              is_leaf=lambda x: isinstance(x, md.NamedArray))
    rest = nnx.state(abstract, nnx.Not(nnx.Param))
    return nnx.merge(graphdef, params, rest)


def export(model: T5) -> dict[str, np.ndarray]:
    """A Hugging Face state dict (numpy arrays) for our ``model``; tied embeddings included."""
    c = model.config
    switch = c.is_moe
    out = {}
    for path, leaf, keys in _mapping(model, switch):
        arr = np.asarray(leaf.array)
        if keys and isinstance(keys[0], tuple):
            key = keys[0][0]
            out[key] = _convert_out(arr, key)
            continue
        for s, layer_keys in enumerate(keys):
            for e, (key, _) in enumerate(layer_keys):
                part = arr[s][e] if "experts" in leaf.names else arr[s]
                out[key] = _convert_out(part, key)
    out["encoder.embed_tokens.weight"] = out["shared.weight"]
    out["decoder.embed_tokens.weight"] = out["shared.weight"]
    if c.tie_embeddings:
        out["lm_head.weight"] = out["shared.weight"]
    return out
