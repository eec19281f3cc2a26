"""meshdsl.models: T5 / MoE-T5, training, Hugging Face import, and decoding.

``meshdsl.models.generate(model, inputs, *, max_new_tokens, method=...)`` is the decoding function
(:mod:`meshdsl.models.generation`); ``python -m meshdsl.models.generate`` is its command line.
"""

from .generation import generate

__all__ = ["generate"]
