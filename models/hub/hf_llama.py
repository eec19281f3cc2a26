"""Weights from and to Hugging Face ``LlamaForCausalLM`` (the Llama-specific half of :mod:`meshdsl.models.hf`),
and its mixture-of-experts kin ``MixtralForCausalLM`` and ``Qwen2MoeForCausalLM`` (their expert
names: :mod:`meshdsl.models.hub.hf_moe`).

Use it through :mod:`meshdsl.models.hf`, which recognises Llama models and directories::

    model = meshdsl.models.hf.load(hf_llama_model)          # a LlamaForCausalLM built or loaded offline
    state_dict = meshdsl.models.hf.export(model)             # {name: numpy array}, loadable by HF
    meshdsl.models.hf.save_pretrained(model, dir)            # model.safetensors + config.json
    model = meshdsl.models.hf.load_pretrained(dir)           # config.json with model_type "llama"

Each of our parameters maps to one Hugging Face tensor per layer, transposed and reshaped by name:

    model.embed_tokens.weight  [vocab, d_model]                 embed.embedding   [vocab, d_model]
    layers.i.self_attn.q_proj  [(kv_heads groups d_head), d_model]  attention.q   [d_model, kv_heads, groups, d_head]
    layers.i.self_attn.k_proj  [(kv_heads d_head), d_model]     attention.k/v     [d_model, kv_heads, d_head]
    layers.i.self_attn.o_proj  [d_model, (kv_heads groups d_head)]  attention.o   [kv_heads, groups, d_head, d_model]
    layers.i.mlp.gate/up_proj  [d_ff, d_model]                  ffn.wi_0 / wi_1   [d_model, d_ff]
    layers.i.mlp.down_proj     [d_model, d_ff]                  ffn.wo            [d_ff, d_model]
    layers.i.input_layernorm, post_attention_layernorm, model.norm  [d_model]  (RMSNorm scales)
    lm_head.weight             [vocab, d_model]                 lm_head.kernel    [d_model, vocab] (untied only)

HF layer ``i`` is entry ``i`` of our ``layers`` dim; HF expert ``e`` entry ``e`` of ``experts``. Query head ``h`` is ``(kv_head, group) =
divmod(h, groups)``: HF's ``repeat_kv`` order. Configurations HF can express but we do not model
(biases, rotary scaling, activations other than SiLU) are refused by name.

A vocabulary that is not a multiple of ``config.vocab_multiple`` (HF's ``vocab_size`` 97, say): the
HF rows fill the first ``vocab`` rows of our tables, the padding rows are zeros (:func:`pad_vocab`),
and export drops them again (:func:`strip_vocab`): HF sees ``vocab_size`` rows. T5's import
(:mod:`meshdsl.models.hf`) does the same with these two functions.
"""

from __future__ import annotations

import jax
import numpy as np
from einops import rearrange
from flax import nnx

import meshdsl as md

from meshdsl.models.families.llama import Llama
from meshdsl.models.families.llama_configs import LlamaConfig

from . import hf_moe

__all__ = ["is_llama_config", "config_from_hf", "hf_config_dict", "from_state_dict", "export", "TIED",
           "pad_vocab", "strip_vocab"]

TIED = ("lm_head.weight",)     # written once: HF ties it to the embedding again on load

# our path inside a layer -> (HF key inside "model.layers.i.", how the tensor converts)
_LAYER = {
    ("attention_norm", "scale"): ("input_layernorm.weight", "same"),
    ("attention", "q", "kernel"): ("self_attn.q_proj.weight", "q"),
    ("attention", "k", "kernel"): ("self_attn.k_proj.weight", "kv"),
    ("attention", "v", "kernel"): ("self_attn.v_proj.weight", "kv"),
    ("attention", "o", "kernel"): ("self_attn.o_proj.weight", "o"),
    ("attention", "q_bias"): ("self_attn.q_proj.bias", "q_bias"),
    ("attention", "k_bias"): ("self_attn.k_proj.bias", "kv_bias"),
    ("attention", "v_bias"): ("self_attn.v_proj.bias", "kv_bias"),
    ("ffn_norm", "scale"): ("post_attention_layernorm.weight", "same"),
    ("ffn", "wi_0", "kernel"): ("mlp.gate_proj.weight", "T"),
    ("ffn", "wi_1", "kernel"): ("mlp.up_proj.weight", "T"),
    ("ffn", "wo", "kernel"): ("mlp.down_proj.weight", "T"),
}
_TOP = {
    ("embed", "embedding"): ("model.embed_tokens.weight", "same"),
    ("norm", "scale"): ("model.norm.weight", "same"),
    ("lm_head", "kernel"): ("lm_head.weight", "T"),
}
_HF_PATTERN = {"q": "(kv g d) m", "kv": "(kv d) m", "o": "m (kv g d)", "q_bias": "(kv g d)", "kv_bias": "(kv d)"}
_OUR_PATTERN = {"q": "m kv g d", "kv": "m kv d", "o": "kv g d m", "q_bias": "kv g d", "kv_bias": "kv d"}


def is_llama_config(hf_config) -> bool:
    """Whether a ``transformers`` config (or ``config.json`` dict) is a Llama's, a Mixtral's or a
    Qwen2-MoE's (the decoders :class:`~meshdsl.models.families.llama.Llama` builds)."""
    return _model_type(hf_config) in ("llama", *hf_moe.MOE_TYPES)


def _model_type(hf_config) -> str:
    return hf_config.get("model_type") if isinstance(hf_config, dict) else getattr(hf_config, "model_type", "")


def _get(c, key, default=None):
    return c.get(key, default) if isinstance(c, dict) else getattr(c, key, default)


def config_from_hf(hf_config) -> LlamaConfig:
    """Our :class:`LlamaConfig` for a ``transformers.LlamaConfig``, ``MixtralConfig`` or
    ``Qwen2MoeConfig`` (or the dict of its ``config.json``)."""
    g = lambda key, default=None: _get(hf_config, key, default)  # noqa: E731
    kind = _model_type(hf_config)
    moe = hf_moe.moe_fields(kind, g) if kind in hf_moe.MOE_TYPES else {}
    problems = [f"{k}=True" for k in ("attention_bias", "mlp_bias") if g(k)]
    if g("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={g('hidden_act')!r} (SiLU only)")
    scaling = g("rope_scaling")
    if scaling and (scaling.get("rope_type") or scaling.get("type")) not in (None, "default"):
        problems.append(f"rope_scaling={scaling!r} (plain RoPE only)")
    if problems:
        raise ValueError(f"unsupported {kind} config: {', '.join(problems)}")
    heads = g("num_attention_heads")
    return LlamaConfig(
        name=g("_name_or_path", "") or kind or "llama", d_model=g("hidden_size"), d_ff=g("intermediate_size"), heads=heads,
        kv_heads=g("num_key_value_heads") or heads, layers=g("num_hidden_layers"), vocab=g("vocab_size"),
        d_head=g("head_dim") or None, rope_theta=float(g("rope_theta", 10000.0)), eps=float(g("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(g("tie_word_embeddings", False)), max_length=g("max_position_embeddings", 2048),
        init_std=float(g("initializer_range", 0.02)), **moe)


def hf_config_dict(config: LlamaConfig) -> dict:
    """``config.json`` of the ``LlamaForCausalLM`` (``MixtralForCausalLM``, ``Qwen2MoeForCausalLM``
    for a MoE) with our ``config``'s architecture (token ids of the training corpus: pad and start
    token 0, eos 1)."""
    if config.qkv_bias and not config.is_moe:
        raise ValueError(f"{config.name}: LlamaForCausalLM cannot express qkv_bias=True (its attention_bias "
                         "biases o_proj too): set qkv_bias=False")
    dense = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": config.d_model,
            "intermediate_size": config.d_ff, "num_attention_heads": config.heads,
            "num_key_value_heads": config.kv_heads, "num_hidden_layers": config.layers, "head_dim": config.head_dim,
            "vocab_size": config.vocab, "rope_theta": config.rope_theta, "rope_scaling": None,
            "rms_norm_eps": config.eps, "tie_word_embeddings": config.tie_embeddings,
            "max_position_embeddings": config.max_length, "initializer_range": config.init_std,
            "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0,
            "pretraining_tp": 1, "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0, "use_cache": True,
            "torch_dtype": "float32"}
    return {**dense, **hf_moe.moe_config_dict(config)} if config.is_moe else dense


def pad_vocab(arr: np.ndarray, dims: md.Shape, config) -> np.ndarray:
    """An imported tensor (our axis order) with ``config.vocab`` entries along our ``vocab`` dim,
    padded with zeros to the model's ``config.padded_vocab``; any other tensor as it is."""
    names = [d.name for d in dims]
    if "vocab" not in names or arr.ndim != len(names):
        return arr
    axis = names.index("vocab")
    if arr.shape[axis] != config.vocab or config.padded_vocab == config.vocab:
        return arr                      # a wrong size is named by the shape check that follows
    widths = [(0, 0)] * arr.ndim
    widths[axis] = (0, config.padded_vocab - config.vocab)
    return np.pad(arr, widths)


def strip_vocab(arr: np.ndarray, names, config) -> np.ndarray:
    """Our tensor (dims ``names``) with only the ``config.vocab`` true entries of ``vocab``."""
    names = list(names)
    if "vocab" not in names:
        return arr
    return np.take(arr, np.arange(config.vocab), axis=names.index("vocab"))


def _to_ours(hf: np.ndarray, kind: str, c: LlamaConfig) -> np.ndarray:
    if kind in _HF_PATTERN:
        return rearrange(hf, f"{_HF_PATTERN[kind]} -> {_OUR_PATTERN[kind]}", kv=c.kv_heads, d=c.head_dim)
    return hf.T if kind == "T" else hf


def _to_hf(ours: np.ndarray, kind: str) -> np.ndarray:
    if kind in _HF_PATTERN:
        return rearrange(ours, f"{_OUR_PATTERN[kind]} -> {_HF_PATTERN[kind]}")
    return ours.T if kind == "T" else ours


def _path_names(path) -> tuple[str, ...]:
    names = [str(getattr(p, "key", getattr(p, "name", getattr(p, "idx", p)))) for p in path]
    return tuple(n for n in names if n != "value")


def _layer_key(config: LlamaConfig, names: tuple[str, ...]):
    """``(HF key inside "model.layers.i.", how it converts)`` of our path ``names`` inside a layer
    (``{e}``: an expert's number)."""
    if config.is_moe and names[0] == "ffn":
        return hf_moe.expert_key(config, names[1:]), "T"
    return _LAYER[names]


def _mapping(model: Llama):
    """``(path, leaf, kind, keys)`` for each of our parameters: ``keys`` an HF key, or a list of
    them per layer (of lists per expert: nested as our leading dims are)."""
    state = nnx.state(model, nnx.Param)
    leaves = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, md.NamedArray))[0]
    c = model.config
    for path, leaf in leaves:
        names = _path_names(path)
        if names[0] == "layers":
            key, kind = _layer_key(c, names[1:])
            keys = [f"model.layers.{i}.{key}" for i in range(c.layers)]
            if "{e}" in key:
                keys = [[k.format(e=e) for e in range(c.experts)] for k in keys]
            yield path, leaf, kind, keys
        else:
            key, kind = _TOP[names]
            yield path, leaf, kind, key


def _flat(keys) -> list[str]:
    """Every HF key of one parameter (a key, or nested lists of them)."""
    return [k for part in keys for k in _flat(part)] if isinstance(keys, list) else [keys]


def _stacked(sd: dict, keys, kind: str, c: LlamaConfig) -> np.ndarray:
    """The HF tensors of nested ``keys`` in our layout, stacked along our leading dims (layers, experts)."""
    if isinstance(keys, list):
        return np.stack([_stacked(sd, k, kind, c) for k in keys])
    return _to_ours(np.asarray(sd[keys]), kind, c)


def _unstack(arr: np.ndarray, keys, kind: str, out: dict) -> None:
    """Our stacked ``arr`` into ``out`` as the HF tensors of nested ``keys``."""
    if not isinstance(keys, list):
        out[keys] = _to_hf(arr, kind)
        return
    for i, k in enumerate(keys):
        _unstack(arr[i], k, kind, out)


def from_state_dict(config: LlamaConfig, sd: dict, dtype=None) -> Llama:
    """Our Llama with the weights of a Hugging Face state dict (numpy arrays)."""
    abstract = nnx.eval_shape(lambda: Llama(config, rngs=nnx.Rngs(0)))
    graphdef, _ = nnx.split(abstract)
    wanted = [k for *_, keys in _mapping(abstract) for k in _flat(keys)]
    missing = [k for k in wanted if k not in sd]
    if missing:
        raise ValueError(f"the Hugging Face weights lack {len(missing)} tensors of this config, e.g. "
                         f"{', '.join(missing[:3])}")
    values = {}
    for path, leaf, kind, keys in _mapping(abstract):
        if isinstance(keys, list):
            arr = _stacked(sd, keys, kind, config)
        else:
            arr = pad_vocab(_to_ours(np.asarray(sd[keys]), kind, config), leaf.dims, config)
        if arr.shape != leaf.dims.sizes:
            raise ValueError(f"HF tensor for {'/'.join(_path_names(path))} has shape {arr.shape}, "
                             f"expected [{leaf.dims}]")
        values[_path_names(path)] = md.param(md.named(arr.astype(dtype or leaf.dtype), leaf.dims))

    params = jax.tree_util.tree_map_with_path(
        lambda path, leaf: values[_path_names(path)] if isinstance(leaf, md.NamedArray) else leaf,
        nnx.state(abstract, nnx.Param), is_leaf=lambda x: isinstance(x, md.NamedArray))
    return nnx.merge(graphdef, params, nnx.state(abstract, nnx.Not(nnx.Param)))


def load(hf_model, *, dtype=None, vocab_multiple: int | None = None) -> Llama:
    """Our Llama with the weights of a ``transformers`` ``LlamaForCausalLM`` (or ``MixtralForCausalLM``,
    ``Qwen2MoeForCausalLM``), built or loaded offline;
    ``vocab_multiple``: the tables' padding (None: the config's default)."""
    sd = {k: v.detach().float().numpy() for k, v in hf_model.state_dict().items()}
    config = config_from_hf(hf_model.config)
    if vocab_multiple is not None:
        config = config.replace(vocab_multiple=vocab_multiple)
    return from_state_dict(config, sd, dtype)


def export(model: Llama) -> dict[str, np.ndarray]:
    """A Hugging Face state dict (numpy arrays) for our ``model``; a tied ``lm_head.weight`` included;
    the vocabulary's padding rows left out."""
    out = {}
    for _, leaf, kind, keys in _mapping(model):
        arr = strip_vocab(np.asarray(leaf.array), leaf.names, model.config)
        if isinstance(keys, list):
            _unstack(arr, keys, kind, out)
        else:
            out[keys] = _to_hf(arr, kind)
    if model.config.tie_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
