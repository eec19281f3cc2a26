"""T5 and MoE-T5, by their public path: ``from meshdsl.models.t5 import T5, count_params``.

A facade: the code lives in :mod:`meshdsl.models.families.t5`.
"""

from meshdsl.models.families.t5 import T5, Stack, count_params

__all__ = ["T5", "Stack", "count_params"]
