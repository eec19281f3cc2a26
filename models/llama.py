"""The decoder-only Llama, by its public path: ``from meshdsl.models.llama import Llama``.

A facade: the code lives in :mod:`meshdsl.models.families.llama`.
"""

from meshdsl.models.families.llama import Llama, LlamaBlock, count_params

__all__ = ["Llama", "LlamaBlock", "count_params"]
