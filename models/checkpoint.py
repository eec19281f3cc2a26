"""Layout-independent checkpoints with orbax.

A checkpoint holds *global* values: every NamedArray is saved whole (orbax writes each device's
shards), with its dims in the tree. Restoring takes the tree of what to restore (concrete or
abstract, e.g. from ``jax.eval_shape``), a mesh and a layout, and places every NamedArray as that
layout says (parameters by its storage rules) - so a run saved on ``data:8`` resumes on
``data:2,model:4`` with a Megatron layout, or on one device.

    save(directory, step, state)                       # state: any pytree of NamedArrays / arrays
    restore(directory, like, mesh, layout, step=None)  # the latest step by default
    shardings(tree, mesh, layout)                      # where each leaf of a state lives

Optimizer states mirror the parameters' tree, so optax leaves NamedArrays whose array is not the
parameter's shape (Adafactor's factored moments drop one dim; unused slots are ``(1,)``). Such a
leaf is placed by the dims its shape still matches (the parameter's dims minus the dropped one),
else replicated; every other non-NamedArray leaf (step counters, RNG keys) is replicated.
"""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from meshdsl.named import NamedArray

__all__ = ["save", "restore", "latest_step", "abstract_like", "shardings"]


def _is_named(x) -> bool:
    return isinstance(x, NamedArray)


def _manager(directory: str, max_to_keep: int | None = 3) -> ocp.CheckpointManager:
    return ocp.CheckpointManager(os.path.abspath(directory),
                                 options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))


def save(directory: str, step: int, state, *, max_to_keep: int | None = 3) -> None:
    """Save ``state`` as step ``step`` under ``directory`` (blocking until written; every process
    of a multi-process run calls it, each writing its own shards)."""
    mgr = _manager(directory, max_to_keep)
    if int(step) in mgr.all_steps():  # a run restarted from an earlier step writes it again
        mgr.delete(int(step))
    mgr.save(int(step), args=ocp.args.StandardSave(state), force=True)
    mgr.wait_until_finished()
    mgr.close()


def latest_step(directory: str) -> int | None:
    """The newest complete checkpoint's step under ``directory`` (None: none)."""
    if not os.path.isdir(directory):
        return None
    mgr = _manager(directory)
    step = mgr.latest_step()
    mgr.close()
    return step


def _spec(x: NamedArray, mesh, layout) -> PartitionSpec:
    """The layout's spec for ``x``; for a reduced optimizer statistic, that of the dims it kept."""
    shape = tuple(x.raw.shape)
    if shape == x.dims.sizes:
        return layout.spec(x.dims, mesh, storage=x.is_param)
    if len(shape) == len(x.dims) - 1:
        for k in range(len(x.dims)):
            kept = [d for i, d in enumerate(x.dims) if i != k]
            if tuple(d.size for d in kept) == shape:
                return layout.spec(kept, mesh, storage=x.is_param)
    return PartitionSpec()


def shardings(tree, mesh, layout):
    """``tree`` with each array replaced by the ``NamedSharding`` that ``layout`` gives it on ``mesh``
    (NamedArray nodes kept, so the result matches ``tree`` for ``jax.jit``'s in/out_shardings)."""
    def leaf(x):
        if _is_named(x):
            return NamedArray(NamedSharding(mesh.jax_mesh, _spec(x, mesh, layout)), x.dims, is_param=x.is_param)
        return NamedSharding(mesh.jax_mesh, PartitionSpec())
    return jax.tree_util.tree_map(leaf, tree, is_leaf=_is_named)


def abstract_like(tree, mesh, layout):
    """``tree`` as ShapeDtypeStructs carrying the shardings ``layout`` gives on ``mesh``."""
    def leaf(x):
        spec = _spec(x, mesh, layout) if _is_named(x) else PartitionSpec()
        arr = x.raw if _is_named(x) else x
        struct = jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=NamedSharding(mesh.jax_mesh, spec))
        return NamedArray(struct, x.dims, is_param=x.is_param) if _is_named(x) else struct
    return jax.tree_util.tree_map(leaf, tree, is_leaf=_is_named)


def restore(directory: str, like, mesh, layout, step: int | None = None):
    """Restore ``step`` (default: the latest) shaped like ``like``, placed by ``layout`` on ``mesh``."""
    mgr = _manager(directory)
    step = mgr.latest_step() if step is None else step
    if step is None:
        mgr.close()
        raise FileNotFoundError(f"no checkpoint under {directory}")
    out = mgr.restore(int(step), args=ocp.args.StandardRestore(abstract_like(like, mesh, layout)))
    mgr.close()
    return out
