"""Llama-style decoder-only configurations.

Published shapes (Llama 2: Touvron et al. 2023; Llama 3: Meta's model cards and the checkpoints'
``config.json``) for the layout search and parameter counts, plus ``llama-tiny`` for CPU work.
``LlamaConfig.replace(...)`` derives variants. ``vocab`` is the true
vocabulary; the tables have ``padded_vocab`` rows (a multiple of ``vocab_multiple``, default 128,
as in :mod:`meshdsl.models.configs`), the padded logits masked by the model. Parameter counts equal Hugging Face's
``LlamaForCausalLM`` of the same config (tests/test_llama_hf.py checks them on the meta device).
Rotary scaling (Llama 3.1's ``rope_scaling``) is not modelled: the configs here use plain RoPE.

Mixture of experts (``experts > 0``): every layer's SwiGLU becomes a dropless top-``top_k`` MoE
(:class:`~meshdsl.layers.DroplessMoE`): Mixtral (``mixtral-*``: ``moe_d_ff`` = ``d_ff``, gates
normalised) and Qwen2-MoE (``qwen2-moe-*``: fine-grained experts of ``moe_d_ff``, a sigmoid-gated
shared expert of ``shared_d_ff``, ``normalize_gates`` HF's ``norm_topk_prob``, q/k/v biases).
Their counts equal HF's ``MixtralForCausalLM`` / ``Qwen2MoeForCausalLM``.
"""

from __future__ import annotations

import dataclasses
import numbers

__all__ = ["LlamaConfig", "LLAMA_CONFIGS", "MOE_DECODER_CONFIGS", "padded_size", "check_vocab_multiple"]


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
    qkv_bias: bool = False                # biases on the query, key and value projections (Qwen's)
    # Mixture of experts (experts = 0: dense), every layer sparse
    experts: int = 0
    top_k: int = 2                        # HF num_experts_per_tok
    moe_d_ff: int | None = None           # each expert's hidden size (default d_ff; HF moe_intermediate_size)
    shared_d_ff: int = 0                  # a shared expert's hidden size (0: none; Qwen2-MoE's)
    normalize_gates: bool = True          # the top-k gates sum to one (Mixtral; Qwen2-MoE norm_topk_prob)
    load_balancing_coef: float = 0.02     # HF router_aux_loss_coef (Mixtral 0.02, Qwen2-MoE 0.001)
    router_z_loss_coef: float = 0.0
    exchange_factor: float | None = None  # expert parallelism's buffer, x a balanced routing's rows (None: never drops)

    def __post_init__(self):
        check_vocab_multiple(self)
        if self.heads % self.kv_heads:
            raise ValueError(f"{self.name}: {self.heads} query heads do not divide into {self.kv_heads} "
                             "key/value heads (grouped-query attention needs heads % kv_heads == 0)")
        if self.experts < 0 or self.shared_d_ff < 0:
            raise ValueError(f"{self.name}: experts={self.experts} and shared_d_ff={self.shared_d_ff} must be >= 0 "
                             "(0: dense / no shared expert)")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"{self.name}: top_k={self.top_k} must be in 1..experts={self.experts}")

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

    @property
    def is_moe(self) -> bool:
        """Whether every layer's feed-forward is a mixture of ``experts``."""
        return self.experts > 0

    @property
    def expert_d_ff(self) -> int:
        """Each expert's hidden size: ``moe_d_ff``, else ``d_ff`` (Mixtral's)."""
        return self.moe_d_ff or self.d_ff

    # what the training and decoding code asks of any model config
    decoder_only = True
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

#: the mixture-of-experts decoders (Mixtral, Qwen2-MoE / Qwen1.5-MoE), in :data:`MODELS` too
MOE_DECODER_CONFIGS: dict[str, LlamaConfig] = {c.name: c for c in [
    LlamaConfig("mixtral-tiny", d_model=64, d_ff=128, heads=4, kv_heads=2, layers=2, vocab=8192, max_length=512,
                experts=8, top_k=2),
    LlamaConfig("qwen2-moe-tiny", d_model=64, d_ff=176, heads=4, kv_heads=4, layers=2, vocab=8192, max_length=512,
                experts=16, top_k=4, moe_d_ff=32, shared_d_ff=128, normalize_gates=False, qkv_bias=True,
                eps=1e-6, load_balancing_coef=0.001),
    LlamaConfig("mixtral-8x7b", 4096, 14336, 32, 8, 32, vocab=32000, rope_theta=1e6, max_length=32768,
                experts=8, top_k=2),
    LlamaConfig("qwen2-moe-a2.7b", 2048, 5632, 16, 16, 24, vocab=151936, rope_theta=1e6, eps=1e-6,
                max_length=8192, experts=60, top_k=4, moe_d_ff=1408, shared_d_ff=5632, normalize_gates=False,
                qkv_bias=True, load_balancing_coef=0.001),
]}
