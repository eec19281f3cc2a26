"""Rematerialisation of a ``md.scan`` step: which of its values the backward pass keeps, by name.

A policy trades compute (and the collectives the step runs again) for the activations each step
holds until the backward pass: ``"none"`` keeps what autodiff keeps, ``"full"`` recomputes the
whole step from its carry, ``"dots"`` keeps the matmuls without batch dims (a layer's projections;
an attention's scores and kernel are recomputed), ``"einsums"`` every einsum result,
``"collectives"`` what collectives produced (recomputing never communicates again),
``"sequence-parallel"`` all but gathered values (Megatron: the backward pass gathers the kept shard
again), or a comma-separated list of value names to keep (``"einsum,all-reduce"``): the rewriter
names einsum results ``"einsum"`` and collective results by kind. Two policies keep in host memory
instead (activation offload): ``"offload"`` moves everything autodiff keeps to the host in the
forward pass and back for the backward pass (no recompute; the host link's time), and
``"offload-dots"`` moves ``"dots"``' matmuls there and recomputes the rest.

``"auto"`` leaves the choice to the planner: it prices :data:`CHOICES` (none, dots, full, and
offload on a GPU or TPU: :func:`choices`) per loop,
each with the memory its steps keep and the time of what it recomputes, and takes the fastest that
fits the memory budget, in the same solve as the placements (:mod:`meshdsl.planner.remat`).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
from jax.ad_checkpoint import Offloadable

from ..names.errors import MeshDSLError
from ..platform.jaxcompat import HOST_MEMORY

__all__ = ["NAMES", "POLICIES", "OFFLOADS", "CHOICES", "OFFLOADING", "choices", "AUTO", "policy", "checked", "wrap", "auto_as", "auto_taken_as"]

# Names the rewriter gives to values (meshdsl.rewrite.collectives, the einsum rule): policies keep or
# recompute them by name.
NAMES = ("einsum", "all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_COLLECTIVES = NAMES[1:]

POLICIES = {
    "none": None,                                                            # keep what autodiff keeps
    "full": jax.checkpoint_policies.nothing_saveable,                       # recompute the whole step
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,       # keep weight matmuls
    "einsums": jax.checkpoint_policies.save_only_these_names("einsum"),     # keep every einsum result
    # keep what collectives produced: the backward pass recomputes, but never communicates again
    "collectives": jax.checkpoint_policies.save_only_these_names(*_COLLECTIVES),
    # Megatron's sequence parallelism: keep the einsums and what every collective but the gather
    # produced; the gathered sequence is not kept: the backward pass gathers the kept shard again
    # (memory of one shard, bytes of one more all-gather)
    "sequence-parallel": jax.checkpoint_policies.save_only_these_names(
        "einsum", *(n for n in _COLLECTIVES if n != "all-gather")),
    # activation offload: what autodiff keeps, or dots' matmuls, in host memory until the backward
    "offload": lambda *_, **__: Offloadable(src="device", dst=HOST_MEMORY),
    "offload-dots": jax.checkpoint_policies.offload_dot_with_no_batch_dims("device", HOST_MEMORY),
}
OFFLOADS = {"offload": "none", "offload-dots": "dots"}   # each offload policy -> the policy whose residuals it moves

AUTO = "auto"
CHOICES = ("none", "dots", "full", "offload", "offload-dots")   # what the planner weighs for remat="auto", its default first
OFFLOADING = ("gpu", "tpu")   # platforms whose compiler places offloaded values in host memory


def choices(platform: str) -> tuple:
    """What the planner weighs for ``remat="auto"`` on ``platform``'s devices: :data:`CHOICES`,
    without ``"offload"`` where the compiler keeps offloaded values in device memory anyway
    (XLA:CPU drops the host placement)."""
    return CHOICES if platform in OFFLOADING else tuple(c for c in CHOICES if c not in OFFLOADS)


def checked(name: str) -> str:
    """``name`` if it is a policy (a name of :data:`POLICIES`, ``"auto"``, or value names to keep);
    else a :class:`MeshDSLError` listing what is."""
    if name == AUTO or name in POLICIES:
        return name
    names = [n.strip() for n in str(name).split(",") if n.strip()]
    unknown = [n for n in names if n not in NAMES]
    if not names or unknown:
        raise MeshDSLError(
            f"remat policy must be one of {sorted(POLICIES)}, {AUTO!r} (the planner chooses among "
            f"{list(CHOICES)}) or a comma-separated list of value names to keep from {list(NAMES)}, "
            f"got {name!r}")
    return name


def policy(name: str):
    """The jax checkpoint policy of a policy name (None: keep what autodiff keeps)."""
    checked(name)
    if name == AUTO:
        raise MeshDSLError("remat='auto' is the planner's to resolve: name a policy of "
                           f"{sorted(POLICIES)} outside md.lower")
    if name in POLICIES:
        return POLICIES[name]
    return jax.checkpoint_policies.save_only_these_names(*(n.strip() for n in name.split(",") if n.strip()))


def wrap(step, name: str | None):
    """``step`` under ``jax.checkpoint`` with the named policy (None or ``"none"``: unchanged)."""
    if name is None or name == "none":
        return step
    return jax.checkpoint(step, policy=policy(name))


_AUTO_AS: contextvars.ContextVar = contextvars.ContextVar("remat_auto_as", default=None)


@contextlib.contextmanager
def auto_as(name: str | None):
    """``remat="auto"`` taken as policy ``name`` while inside (None: the planner's choice): the
    search's memory screen traces the policy that holds least, a bound on what any plan holds."""
    token = _AUTO_AS.set(name)
    try:
        yield
    finally:
        _AUTO_AS.reset(token)


def auto_taken_as() -> str | None:
    """The policy ``remat="auto"`` is taken as here (:func:`auto_as`), or None."""
    return _AUTO_AS.get()
