"""Python's cyclic garbage collector held off while the rewriter traces.

A trace makes many objects and few garbage cycles, and the collections the allocations trigger
scan every object alive, the traced programs and jax's caches included: half of a T5-xxl trace's
time where measured, and in a layout search (many traces, a heap that grows) a fifth of it. The
rewriter pauses the collector for a trace (:func:`paused`), and a search between two layouts
collects what one layout left (:func:`collect_young`: the young generations, where its garbage
is, not the old one that holds the program and jax).
"""

from __future__ import annotations

import contextlib
import gc

__all__ = ["paused", "collect_young"]


@contextlib.contextmanager
def paused():
    """No automatic collection inside (restored as it was after)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def collect_young() -> None:
    """Collect the two young generations: the garbage made since the last collection."""
    gc.collect(1)
