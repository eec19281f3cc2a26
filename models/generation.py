"""Decoding, by its public path: ``from meshdsl.models.generation import generate, Generator, cache_length``
(``meshdsl.models.generate`` is the same function).

A facade: the code lives in :mod:`meshdsl.models.decoding.generation`.
"""

from meshdsl.models.decoding.generation import METHODS, Generator, cache_length, generate

__all__ = ["generate", "Generator", "METHODS", "cache_length"]
