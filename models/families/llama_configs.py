"""Llama-style decoder-only configurations.

Published shapes (Llama 2: Touvron et al. 2023; Llama 3: Meta's model cards and the checkpoints'
``config.json``) for the layout search and parameter counts, plus ``llama-tiny`` for CPU work.
``LlamaConfig.replace(...)`` derives variants. ``vocab`` is the true
vocabulary; the tables have ``padded_vocab`` rows (a multiple of ``vocab_multiple``, default 128,
as in :mod:`meshdsl.models.configs`), the padded logits masked by the model. Parameter counts equal Hugging Face's
``LlamaForCausalLM`` of the same config (tests/test_llama_hf.py checks them on the meta device).
Rotary scaling (Llama 3.1's ``rope_scaling``) is not modelled: the configs here use plain RoPE.
"""

from __future__ import annotations

import dataclasses
import numbers

__all__ = ["LlamaConfig", "LLAMA_CONFIGS", "padded_size", "check_vocab_multiple"]


def padded_size(size: int, multiple: int) -> int:
    """``size`` rounded up to a multiple of ``multiple``."""
    return -(-size // multiple) * multiple


def check_vocab_multiple(config) -> None:
    """ValueError unless ``config.vocab`` and ``config.vocab_multiple`` are positive ints."""
    for key in ("vocab", "vocab_multiple"):
        value = getattr(config, key)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{config.name}: {key} must be a positive int, got {value!r}"
                             + (" (1: no padding of the vocabulary)" if key == "vocab_multiple" else ""))


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Sizes and switches of a Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU)."""

    name: str
    d_model: int
    d_ff: int
    heads: int                            # query heads
    kv_heads: int                         # key/value heads (GQA: heads % kv_heads == 0)
    layers: int
    vocab: int = 32000                    # the true vocabulary (token ids 0 .. vocab-1)
    vocab_multiple: int = 128             # the tables' vocab dim is padded to a multiple (Megatron's)
    d_head: int | None = None             # default d_model // heads
    rope_theta: float = 10000.0
    eps: float = 1e-5                     # RMSNorm's (HF rms_norm_eps)
    tie_embeddings: bool = False
    max_length: int = 4096                # HF max_position_embeddings (recorded; RoPE has no table)
    init_std: float = 0.02                # HF initializer_range: the embedding's init stddev
    activation: str = "gated-silu"        # SwiGLU: down(silu(gate(x)) * up(x))
    z_loss: float = 0.0                   # T5X's auxiliary loss on the logits' log-partition

    def __post_init__(self):
        check_vocab_multiple(self)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} query heads do not divide into {self.kv_heads} "
                             "key/value heads (grouped-query attention needs heads % kv_heads == 0)")

    def replace(self, **changes) -> LlamaConfig:
        return dataclasses.replace(self, **changes)

    @property
    def padded_vocab(self) -> int:
        """The size of the model's ``vocab`` dim: ``vocab`` rounded up to a multiple of ``vocab_multiple``."""
        return padded_size(self.vocab, self.vocab_multiple)

    @property
    def head_dim(self) -> int:
        return self.d_head or self.d_model // self.heads

    @property
    def groups(self) -> int:
        """Query heads per key/value head."""
        return self.heads // self.kv_heads

    # what the training and decoding code asks of any model config
    decoder_only = True
    is_moe = False
    period = 1


def _llama2(name, d_model, d_ff, heads, kv_heads, layers):
    return LlamaConfig(name, d_model, d_ff, heads, kv_heads, layers, vocab=32000, max_length=4096)


def _llama3(name, d_model, d_ff, heads, kv_heads, layers):
    return LlamaConfig(name, d_model, d_ff, heads, kv_heads, layers, vocab=128256, rope_theta=500000.0,
                       max_length=8192)


LLAMA_CONFIGS: dict[str, LlamaConfig] = {c.name: c for c in [
    LlamaConfig("llama-tiny", d_model=64, d_ff=176, heads=4, kv_heads=2, layers=2, vocab=8192, max_length=512),
    _llama2("llama-2-7b", 4096, 11008, 32, 32, 32),
    _llama2("llama-2-13b", 5120, 13824, 40, 40, 40),
    _llama2("llama-2-70b", 8192, 28672, 64, 8, 80),
    _llama3("llama-3-8b", 4096, 14336, 32, 8, 32),
    _llama3("llama-3-70b", 8192, 28672, 64, 8, 80),
]}
