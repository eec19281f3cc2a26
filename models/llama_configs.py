"""The Llama configs, by their public path: ``from meshdsl.models.llama_configs import LLAMA_CONFIGS``.

A facade: the code lives in :mod:`meshdsl.models.families.llama_configs`.
"""

from meshdsl.models.families.llama_configs import (LLAMA_CONFIGS, MOE_DECODER_CONFIGS, LlamaConfig,
                                                   check_vocab_multiple, padded_size)

__all__ = ["LlamaConfig", "LLAMA_CONFIGS", "MOE_DECODER_CONFIGS", "padded_size", "check_vocab_multiple"]
