"""meshdsl.models: T5 / MoE-T5, the decoder-only Llama, training, Hugging Face import, and decoding.

``Llama`` (:mod:`meshdsl.models.llama`) and its ``LlamaConfig`` (``llama-tiny``, ``llama-2-7b``,
``llama-3-8b``, ...: :data:`meshdsl.models.configs.MODELS`) are exported here.

``meshdsl.models.generate(model, inputs, *, max_new_tokens, method=...)`` is the decoding function
(:mod:`meshdsl.models.generation`); ``python -m meshdsl.models.generate`` is its command line
(``from meshdsl.models.generate import main, span_filling_accuracy``). Importing that submodule
does not rebind the name ``generate`` here: it stays the function.

The code lives in subpackages by concept, each importing only the floors below it (its docstring
says which): :mod:`~meshdsl.models.data` (corpus, vocabulary, batches), :mod:`~meshdsl.models.families`
(T5, Llama, configs, losses), :mod:`~meshdsl.models.hub` (Hugging Face), :mod:`~meshdsl.models.decoding`
(generation), :mod:`~meshdsl.models.training` (trainer, loop, checkpoints) and :mod:`~meshdsl.models.cli`
(the commands). The modules at this level (``llama``, ``llama_configs``, ``t5``, ``configs``, ``loss``,
``inference``, ``generation``, ``hf``, ``autolayout``, ``train``, ``generate``, ``export``) are
facades: the public paths, re-exporting the subpackages' names (docs/architecture.md has the map).

The models pad their vocabulary (``vocab_multiple`` of their configs); importing this package
names that option in the layout error for a split that does not divide ``vocab``.
"""

import math
import sys
import types

from meshdsl.names.layout import register_padding_hint

from .decoding.generation import generate
from .families.llama import Llama
from .families.llama_configs import LlamaConfig

__all__ = ["generate", "Llama", "LlamaConfig"]


def _vocab_hint(devices: int) -> str:
    multiple = math.lcm(128, devices)
    return (f"'vocab' is padded by the model config's vocab_multiple: e.g. --override vocab_multiple={multiple}, "
            f"or config.replace(vocab_multiple={multiple})")


register_padding_hint("vocab", _vocab_hint)


class _Package(types.ModuleType):
    def __setattr__(self, name, value):
        if name == "generate" and isinstance(value, types.ModuleType):
            return      # the import system binding the CLI submodule: keep the function
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
