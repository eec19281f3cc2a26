"""The training losses, by their public path: ``from meshdsl.models.loss import t5_loss, lm_loss``.

A facade: the code lives in :mod:`meshdsl.models.families.loss`.
"""

from meshdsl.models.families.loss import batch_arrays, cross_entropy, lm_loss, t5_loss

__all__ = ["cross_entropy", "t5_loss", "lm_loss", "batch_arrays"]
