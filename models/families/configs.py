"""T5 and Switch/GShard MoE-T5 configurations.

Published T5 sizes (Raffel et al. 2020 for v1.0; the v1.1 checkpoints' configs) plus ``t5-tiny``
and ``moe-t5-tiny`` for CPU work. ``T5Config.replace(...)`` derives variants (vocabulary size,
dropout, experts, ...). Parameter counts of the published configs equal the published ones
(tests/test_models.py checks them against Hugging Face's own count).

``vocab`` is the true vocabulary; the embedding and output tables have ``padded_vocab`` rows,
``vocab`` rounded up to a multiple of ``vocab_multiple`` (default 128, as Megatron's
``--make-vocab-size-divisible-by``), so that a layout may split ``vocab`` over a mesh axis whatever
the tokenizer's size; the model masks the padded logits (``vocab_multiple=1``: no padding). Every
published config's vocabulary is already a multiple of 128: their shapes do not change.

:data:`MODELS` adds the Llama-style decoder-only configs (:mod:`meshdsl.models.llama_configs`, the
Mixtral and Qwen2-MoE ones too):
:func:`get_config` and the training CLI's ``--model`` take any of them; :func:`config_from_dict`
rebuilds either kind from a run's ``run.json``.
"""

from __future__ import annotations

import dataclasses

from .llama_configs import LLAMA_CONFIGS, MOE_DECODER_CONFIGS, LlamaConfig, check_vocab_multiple, padded_size

__all__ = ["T5Config", "LlamaConfig", "CONFIGS", "LLAMA_CONFIGS", "MOE_DECODER_CONFIGS", "MODELS", "get_config",
           "config_from_dict"]


@dataclasses.dataclass(frozen=True)
class T5Config:
    """Sizes and switches of an encoder-decoder T5 (dense, or MoE in every ``moe_every``-th FFN)."""

    name: str
    d_model: int
    d_ff: int
    heads: int
    d_kv: int
    encoder_layers: int
    decoder_layers: int
    vocab: int = 32128                    # the true vocabulary (token ids 0 .. vocab-1)
    vocab_multiple: int = 128             # the tables' vocab dim is padded to a multiple (Megatron's)
    activation: str = "gated-gelu"        # v1.1 "gated-gelu"; v1.0 "relu"
    tie_embeddings: bool = False          # v1.0 ties the output layer to the input embedding
    dropout_rate: float = 0.0
    num_buckets: int = 32
    max_distance: int = 128
    eps: float = 1e-6
    # Mixture of experts (num_experts = 0: dense)
    num_experts: int = 0
    moe_every: int = 2                    # layer i is sparse when i % moe_every == moe_every - 1
    top_k: int = 1                        # 1: Switch, 2: GShard
    expert_d_ff: int | None = None        # default: d_ff
    expert_activation: str = "relu"
    capacity_factor: float = 1.25
    eval_capacity_factor: float = 2.0
    expert_capacity: int | None = None    # a fixed number of slots (Hugging Face's config) instead
    group_size: int | None = None         # tokens per routing group (default: one sequence)
    jitter_noise: float = 0.0
    moe_dropped: str = "zero"             # a dropped token's output: "zero", or "hf" (gate * input)
    load_balancing_coef: float = 1e-2
    router_z_loss_coef: float = 1e-3
    # training objective
    z_loss: float = 1e-4                  # T5X's auxiliary loss on the output logits' log-partition

    def __post_init__(self):
        check_vocab_multiple(self)

    def replace(self, **changes) -> T5Config:
        return dataclasses.replace(self, **changes)

    @property
    def padded_vocab(self) -> int:
        """The size of the model's ``vocab`` dim: ``vocab`` rounded up to a multiple of ``vocab_multiple``."""
        return padded_size(self.vocab, self.vocab_multiple)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def period(self) -> int:
        """Layers per scanned step: 1 for a dense stack, ``moe_every`` when layers alternate."""
        return self.moe_every if self.is_moe else 1


def _v11(name, d_model, d_ff, heads, layers, d_kv=64):
    return T5Config(name, d_model, d_ff, heads, d_kv, layers, layers)


def _v10(name, d_model, d_ff, heads, layers, d_kv=64):
    return T5Config(name, d_model, d_ff, heads, d_kv, layers, layers, activation="relu", tie_embeddings=True,
                    dropout_rate=0.1)


CONFIGS: dict[str, T5Config] = {c.name: c for c in [
    T5Config("t5-tiny", d_model=128, d_ff=256, heads=4, d_kv=32, encoder_layers=2, decoder_layers=2, vocab=8192),
    T5Config("moe-t5-tiny", d_model=128, d_ff=256, heads=4, d_kv=32, encoder_layers=2, decoder_layers=2,
             vocab=8192, num_experts=8, expert_d_ff=256),
    _v11("t5-v1_1-small", 512, 1024, 6, 8),
    _v11("t5-v1_1-base", 768, 2048, 12, 12),
    _v11("t5-v1_1-large", 1024, 2816, 16, 24),
    _v11("t5-v1_1-xl", 2048, 5120, 32, 24),
    _v11("t5-v1_1-xxl", 4096, 10240, 64, 24),
    _v10("t5-small", 512, 2048, 8, 6),
    _v10("t5-base", 768, 3072, 12, 12),
    _v10("t5-large", 1024, 4096, 16, 24),
    _v10("t5-3b", 1024, 16384, 32, 24, d_kv=128),
    _v10("t5-11b", 1024, 65536, 128, 24, d_kv=128),
    T5Config("switch-base-8", 768, 3072, 12, 64, 12, 12, activation="relu", tie_embeddings=True,
             num_experts=8, expert_d_ff=3072,
             expert_capacity=64, jitter_noise=0.01, dropout_rate=0.1),
]}


#: every model the training CLI knows: T5 / MoE-T5 and the Llama-style decoders (dense and MoE)
MODELS: dict[str, T5Config | LlamaConfig] = {**CONFIGS, **LLAMA_CONFIGS, **MOE_DECODER_CONFIGS}


def get_config(name: str, **changes) -> T5Config | LlamaConfig:
    if name not in MODELS:
        import difflib
        close = difflib.get_close_matches(name, MODELS, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown model {name!r}{hint}; choose one of {sorted(MODELS)}")
    return MODELS[name].replace(**changes) if changes else MODELS[name]


def config_from_dict(values: dict) -> T5Config | LlamaConfig:
    """The config a run recorded (``run.json``'s ``"config"``): a Llama config has ``kv_heads``."""
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in values.items()}
    return LlamaConfig(**values) if "kv_heads" in values else T5Config(**values)
