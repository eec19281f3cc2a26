"""Weights from and to Hugging Face ``transformers``: T5 v1.0, v1.1, SwitchTransformers, Llama, Mixtral and Qwen2-MoE.

    model = meshdsl.models.hf.load(hf_model)    # T5ForConditionalGeneration or
                                                # SwitchTransformersForConditionalGeneration
    state_dict = meshdsl.models.hf.export(model)  # {name: numpy array}, loadable by HF
    meshdsl.models.hf.save_pretrained(model, dir)  # model.safetensors + config.json (+ spiece.model)
    model = meshdsl.models.hf.load_pretrained(dir)  # such a directory (or HF's own), without torch

``save_pretrained`` writes what ``transformers``' ``from_pretrained(dir)`` reads (the same logits);
``load_pretrained`` needs only ``safetensors`` and numpy (``python -m meshdsl.models.export`` turns a
training run's checkpoint into such a directory).

The configuration is read from ``hf_model.config``. Each of our parameters maps to one HF tensor
(or one per expert), transposed and reshaped by name: HF's ``q.weight`` ``[heads*d_kv, d_model]``
is our ``q.kernel`` ``[d_model, heads, d_kv]``; HF block ``i`` is our stacked step ``i // period``,
slot ``i % period``. Nothing is downloaded: pass a model you built or loaded yourself.

Llama (``LlamaForCausalLM``, ``model_type: "llama"``) goes through the same four functions; its
name map is :mod:`meshdsl.models.hub.hf_llama`. So do the mixture-of-experts decoders
``MixtralForCausalLM`` (``"mixtral"``) and ``Qwen2MoeForCausalLM`` (``"qwen2_moe"``): our Llama
with ``experts``, the experts' names in :mod:`meshdsl.models.hub.hf_moe`.

A vocabulary that does not divide the mesh (HF's ``vocab_size`` 97, GPT-2's 50257): our config keeps
the true ``vocab`` and its tables have ``padded_vocab`` rows (``vocab_multiple``, default 128; pass
``vocab_multiple=`` to :func:`load` / :func:`load_pretrained` for another). The HF rows fill the
first ``vocab`` rows, the padding rows are zeros and the model masks their logits; :func:`export`
and :func:`save_pretrained` leave them out, so HF sees ``vocab_size`` rows and ``vocab_size`` in
``config.json``.
"""

from __future__ import annotations

import json
import os
import re

import jax
import numpy as np
from einops import rearrange
from flax import nnx

import meshdsl as md

from meshdsl.models.families.configs import LlamaConfig, T5Config
from meshdsl.models.families.llama import Llama
from meshdsl.models.families.t5 import T5

from . import hf_llama, hf_moe

__all__ = ["load", "export", "config_from_hf", "save_pretrained", "load_pretrained", "hf_config_dict"]


class _Attrs:
    """A ``config.json`` dict read like a ``transformers`` config object (HF's defaults where absent)."""

    _DEFAULTS = dict(num_decoder_layers=None, tie_word_embeddings=True, dropout_rate=0.1,
                     relative_attention_num_buckets=32, relative_attention_max_distance=128,
                     layer_norm_epsilon=1e-6, feed_forward_proj="relu", router_jitter_noise=0.01,
                     router_aux_loss_coef=0.001, router_z_loss_coef=0.001, expert_capacity=64, num_experts=8,
                     _name_or_path="")

    def __init__(self, values: dict):
        self.__dict__.update({**self._DEFAULTS, **values})


def _is_switch_config(c) -> bool:
    return type(c).__name__.startswith("SwitchTransformers") or getattr(c, "model_type", "") == "switch_transformers"


def config_from_hf(hf_config) -> T5Config:
    """Our :class:`T5Config` for a ``transformers`` T5Config or SwitchTransformersConfig (or the dict
    of its ``config.json``)."""
    c = _Attrs(hf_config) if isinstance(hf_config, dict) else hf_config
    switch = _is_switch_config(c)
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
        return rearrange(hf, "(heads d_kv) d_model -> d_model heads d_kv", heads=heads)
    if re.search(r"Attention\.o\.weight$", key):
        return rearrange(hf, "d_model (heads d_kv) -> heads d_kv d_model", heads=heads)
    if key.endswith(("layer_norm.weight", "relative_attention_bias.weight")) or key == "shared.weight":
        return hf
    return hf.T


def _convert_out(ours: np.ndarray, key: str) -> np.ndarray:
    if re.search(r"Attention\.[qkv]\.weight$", key):
        return rearrange(ours, "d_model heads d_kv -> (heads d_kv) d_model")
    if re.search(r"Attention\.o\.weight$", key):
        return rearrange(ours, "heads d_kv d_model -> d_model (heads d_kv)")
    if key.endswith(("layer_norm.weight", "relative_attention_bias.weight")) or key == "shared.weight":
        return ours
    return ours.T


def _is_switch(hf_model) -> bool:
    return _is_switch_config(hf_model.config)


def load(hf_model, *, dtype=None, vocab_multiple: int | None = None) -> T5 | Llama:
    """Our T5 / MoE-T5 / Llama with the weights of a ``transformers`` model (built or loaded offline).
    ``vocab_multiple``: the tables' rows are the vocabulary rounded up to a multiple of it (None:
    the config's default, 128; 1: no padding)."""
    if hf_llama.is_llama_config(hf_model.config):
        return hf_llama.load(hf_model, dtype=dtype, vocab_multiple=vocab_multiple)
    config = _with_multiple(config_from_hf(hf_model.config), vocab_multiple)
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    return _from_state_dict(config, sd, _is_switch(hf_model), dtype)


def _with_multiple(config, vocab_multiple):
    return config if vocab_multiple is None else config.replace(vocab_multiple=vocab_multiple)


def _from_state_dict(config: T5Config, sd: dict, switch: bool, dtype=None) -> T5:
    """Our model with the weights of a Hugging Face state dict (numpy arrays)."""
    abstract = nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    values = {}
    missing = sorted({k for _, _, keys in _mapping(abstract, switch)
                      for k in ([keys[0][0]] if keys and isinstance(keys[0], tuple) else
                                [key for layer in keys for key, _ in layer]) if k not in sd})
    if missing:
        raise ValueError(f"the Hugging Face weights lack {len(missing)} tensors of this config, e.g. "
                         f"{', '.join(missing[:3])}")
    for path, leaf, keys in _mapping(abstract, switch):
        if keys and isinstance(keys[0], tuple):
            arr = hf_llama.pad_vocab(_convert_in(sd[keys[0][0]], keys[0][0], config.heads), leaf.dims, config)
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


def export(model: T5 | Llama) -> dict[str, np.ndarray]:
    """A Hugging Face state dict (numpy arrays) for our ``model``; tied embeddings included; the
    vocabulary's padding rows left out."""
    if isinstance(model, Llama):
        return hf_llama.export(model)
    c = model.config
    switch = c.is_moe
    out = {}
    for path, leaf, keys in _mapping(model, switch):
        arr = hf_llama.strip_vocab(np.asarray(leaf.array), leaf.names, c)
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


# -- Hugging Face directories -----------------------------------------------------------------------

def hf_config_dict(config: T5Config | LlamaConfig) -> dict:
    """``config.json`` of the ``transformers`` model with our ``config``'s architecture (its true
    vocabulary: HF's tables have no padding rows)."""
    if isinstance(config, LlamaConfig):
        return hf_llama.hf_config_dict(config)
    common = {"d_model": config.d_model, "d_ff": config.d_ff, "d_kv": config.d_kv, "num_heads": config.heads,
              "num_layers": config.encoder_layers, "num_decoder_layers": config.decoder_layers,
              "vocab_size": config.vocab, "dropout_rate": config.dropout_rate,
              "relative_attention_num_buckets": config.num_buckets,
              "relative_attention_max_distance": config.max_distance, "layer_norm_epsilon": config.eps,
              "tie_word_embeddings": config.tie_embeddings, "is_encoder_decoder": True, "pad_token_id": 0,
              "eos_token_id": 1, "decoder_start_token_id": 0, "initializer_factor": 1.0, "use_cache": True,
              "torch_dtype": "float32"}
    if not config.is_moe:
        return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5",
                "feed_forward_proj": config.activation, **common}
    problems = []
    if config.top_k != 1:
        problems.append(f"top_k {config.top_k} (Switch routes each token to 1 expert)")
    if (config.expert_d_ff or config.d_ff) != config.d_ff:
        problems.append(f"expert_d_ff {config.expert_d_ff} != d_ff {config.d_ff}")
    if config.expert_capacity is None:
        problems.append("no fixed expert_capacity (set one, e.g. --override expert_capacity=64)")
    if config.activation != "relu" or config.expert_activation != "relu":
        problems.append("activations other than relu")
    if config.encoder_layers % config.moe_every or config.decoder_layers % config.moe_every:
        problems.append(f"layers not a multiple of moe_every {config.moe_every}")
    if problems:
        raise ValueError(f"{config.name}: Hugging Face's SwitchTransformers cannot express {'; '.join(problems)}")
    return {"architectures": ["SwitchTransformersForConditionalGeneration"], "model_type": "switch_transformers",
            "num_experts": config.num_experts, "expert_capacity": config.expert_capacity,
            "encoder_sparse_step": config.moe_every, "decoder_sparse_step": config.moe_every,
            "num_sparse_encoder_layers": config.encoder_layers // config.moe_every,
            "num_sparse_decoder_layers": config.decoder_layers // config.moe_every,
            "router_jitter_noise": config.jitter_noise, "router_aux_loss_coef": config.load_balancing_coef,
            "router_z_loss_coef": config.router_z_loss_coef, "router_bias": False, "router_dtype": "float32",
            "router_ignore_padding_tokens": False, "dense_act_fn": "relu", **common}


_TIED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")


def save_pretrained(model: T5 | Llama, directory: str | os.PathLike, *, vocab=None) -> str:
    """Write ``model`` as a Hugging Face directory: ``model.safetensors`` (float32), ``config.json``
    and, given the run's :class:`~meshdsl.models.data.corpus.Vocabulary`, its sentencepiece model as
    ``spiece.model`` (T5's name; ``tokenizer.model`` for Llama). ``transformers``'
    ``from_pretrained(directory)`` then gives our logits. Tied tensors are written once (HF ties
    them again on load). Returns the directory."""
    from safetensors.numpy import save_file

    llama = isinstance(model, Llama)
    # first: a config HF cannot express fails before writing
    config = hf_config_dict(model.config)
    directory = os.fspath(directory)
    os.makedirs(directory, exist_ok=True)
    state = export(model)
    tied = (set() if llama else set(_TIED)) | ({"lm_head.weight"} if model.config.tie_embeddings else set())
    tensors = {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in state.items() if k not in tied}
    save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    if vocab is not None:
        with open(os.path.join(directory, "tokenizer.model" if llama else "spiece.model"), "wb") as f:
            f.write(vocab.model_proto if hasattr(vocab, "model_proto") else bytes(vocab))
    return directory


def load_pretrained(directory: str | os.PathLike, *, dtype=None,
                    vocab_multiple: int | None = None) -> T5 | Llama:
    """Our T5 / MoE-T5 / Llama from a Hugging Face directory (``config.json`` + ``model.safetensors`` or a
    sharded ``model.safetensors.index.json``), with numpy and safetensors only: no torch.
    ``vocab_multiple``: as for :func:`load`."""
    from safetensors.numpy import load_file

    directory = os.fspath(directory)
    try:
        with open(os.path.join(directory, "config.json")) as f:
            hf_config = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(f"{directory} has no config.json: not a Hugging Face model directory") from None
    single, index = os.path.join(directory, "model.safetensors"), os.path.join(directory, "model.safetensors.index.json")
    if os.path.exists(single):
        files = [single]
    elif os.path.exists(index):
        with open(index) as f:
            files = [os.path.join(directory, n) for n in sorted(set(json.load(f)["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"{directory} has no model.safetensors (only safetensors weights are read without "
                                "torch; convert pytorch_model.bin with transformers' save_pretrained)")
    state = {}
    for path in files:
        state.update(load_file(path))
    state = {k: np.asarray(v, np.float32) for k, v in state.items()}
    if hf_llama.is_llama_config(hf_config):
        config = _with_multiple(hf_llama.config_from_hf(hf_config), vocab_multiple)
        if config.name in ("", "llama", *hf_moe.MOE_TYPES):
            config = config.replace(name=os.path.basename(os.path.normpath(directory)))
        return hf_llama.from_state_dict(config, state, dtype)
    if "shared.weight" not in state:
        for key in _TIED:
            if key in state:
                state["shared.weight"] = state[key]
                break
    config = _with_multiple(config_from_hf(hf_config), vocab_multiple)
    if config.name in ("", "_Attrs"):
        config = config.replace(name=os.path.basename(os.path.normpath(directory)))
    return _from_state_dict(config, state, _is_switch_config(_Attrs(hf_config)), dtype)
