"""The model configs, by their public path: ``from meshdsl.models.configs import get_config``
(``MODELS``: T5 / MoE-T5, Llama, Mixtral and Qwen2-MoE by name).

A facade: the code lives in :mod:`meshdsl.models.families.configs`.
"""

from meshdsl.models.families.configs import (CONFIGS, LLAMA_CONFIGS, MODELS, MOE_DECODER_CONFIGS, LlamaConfig,
                                             T5Config, config_from_dict, get_config)

__all__ = ["T5Config", "LlamaConfig", "CONFIGS", "LLAMA_CONFIGS", "MOE_DECODER_CONFIGS", "MODELS", "get_config",
           "config_from_dict"]
