"""``--layout auto`` (``md.search`` over a training step), by its public path:
``from meshdsl.models.autolayout import abstract_batch, step_of``.

A facade: the code lives in :mod:`meshdsl.models.training.autolayout`.
"""

from meshdsl.models.training.autolayout import (DEFAULT_MESH, REMAT_CHOICES, abstract_batch, choose, choose_for_run,
                                                rules_text, step_of)

__all__ = ["DEFAULT_MESH", "REMAT_CHOICES", "abstract_batch", "choose", "choose_for_run", "rules_text", "step_of"]
