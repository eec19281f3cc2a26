"""Which model a config builds, which loss trains it, and how a run describes it.

The training CLI, the trainer, ``--layout auto``, ``export`` and ``generate`` take any config of
:data:`meshdsl.models.configs.MODELS`: an encoder-decoder :class:`~meshdsl.models.configs.T5Config`
(T5 / MoE-T5, trained by :func:`~meshdsl.models.loss.t5_loss`) or a decoder-only
:class:`~meshdsl.models.llama_configs.LlamaConfig` (Llama, trained by
:func:`~meshdsl.models.loss.lm_loss`, the ``lm`` task only).
"""

from __future__ import annotations

from .configs import LlamaConfig, T5Config
from .llama import Llama
from .llama import count_params as _llama_params
from .loss import lm_loss, t5_loss
from .t5 import T5
from .t5 import count_params as _t5_params

__all__ = ["is_decoder_only", "model_class", "objective", "count_params", "describe", "TASKS"]


def is_decoder_only(config) -> bool:
    return bool(getattr(config, "decoder_only", False))


#: the training tasks each kind of model can learn
TASKS = {"encoder-decoder": ("span_corruption", "lm"), "decoder-only": ("lm",)}


def model_class(config: T5Config | LlamaConfig):
    """The model class of ``config``: ``Llama`` or ``T5``."""
    return Llama if isinstance(config, LlamaConfig) else T5


def objective(config: T5Config | LlamaConfig):
    """``loss(model, batch, *, key, train, remat) -> (loss, metrics)`` that trains ``config``'s model."""
    return lm_loss if is_decoder_only(config) else t5_loss


def count_params(config: T5Config | LlamaConfig) -> int:
    """Parameters of ``config``'s model, counted abstractly (nothing is materialized)."""
    return _llama_params(config) if isinstance(config, LlamaConfig) else _t5_params(config)


def describe(config: T5Config | LlamaConfig) -> str:
    """``name: N M parameters (sizes)``, one line for the training CLI's summary."""
    if isinstance(config, LlamaConfig):
        ffn = (f"{config.experts} experts top-{config.top_k} x d_ff {config.expert_d_ff}"
               + (f" + shared {config.shared_d_ff}" if config.shared_d_ff else "")) if config.is_moe \
            else f"d_ff {config.d_ff}"
        sizes = (f"d_model {config.d_model}, {ffn}, heads {config.heads} ({config.kv_heads} kv) x "
                 f"{config.head_dim}, layers {config.layers}, vocab {_vocab(config)}"
                 f"{', tied embeddings' if config.tie_embeddings else ''}")
    else:
        experts = f", {config.num_experts} experts" if config.is_moe else ""
        sizes = (f"d_model {config.d_model}, d_ff {config.d_ff}, heads {config.heads}x{config.d_kv}, layers "
                 f"{config.encoder_layers}+{config.decoder_layers}{experts}, vocab {_vocab(config)}")
    return f"{config.name}: {count_params(config) / 1e6:.2f}M parameters ({sizes})"


def _vocab(config) -> str:
    """``97 (padded to 128)``: the true vocabulary and, when they differ, the tables' rows."""
    padded = config.padded_vocab
    return f"{config.vocab}" + (f" (padded to {padded})" if padded != config.vocab else "")
