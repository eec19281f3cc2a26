"""Stacks of identical layers: one module whose parameters carry a ``layers`` dim, run by ``md.scan``.

Build any layer with ``stack=md.Dim("layers", L)``: every parameter becomes ``[layers, ...]``.
:func:`scan_layers` splits the module into its graph and state (``nnx.split``), scans ``md.scan``
over the state's ``layers`` dim and rebuilds one layer per step (``nnx.merge``), so the program
holds one copy of the layer's code whatever the depth: compile time does not grow with ``L``.

    carry, ys = scan_layers(stack, carry, step)      step(layer, carry, key) -> (carry, y)

``ys`` come back stacked along ``layers``. With a ``key``, step ``l`` gets
``jax.random.fold_in(key, l)`` (the same keys :func:`layer_at` loops use), else ``None``.
``remat`` trades compute for memory per step, by name (:data:`REMAT_POLICIES`, or ``"auto"``: the
planner chooses none, dots or full by the step's time under the memory budget): ``"none"`` keeps
the activations the backward pass needs, ``"full"`` recomputes the whole step, ``"dots"`` keeps
matmul results without batch dims, ``"einsums"`` keeps every einsum result, ``"collectives"`` keeps
what collectives produced (recomputing never communicates again), ``"sequence-parallel"`` keeps all
but gathered values (Megatron: keep the sequence shard, gather it again backward), or a list of
value names to keep (``"einsum,all-reduce"``): the rewriter names einsum results ``"einsum"`` and
collective results by kind.

Communication is the layers' own, once per step (``md.explain`` counts it times ``L``); a layout
must not split ``layers`` for computation, though a ``params=`` rule may store it split.
Parameters stored split (ZeRO-3) are gathered in the step; ``md.lower(..., param_gather=...)``
chooses whether the backward pass keeps or re-gathers them.
"""

from __future__ import annotations

import jax
from flax import nnx

import meshdsl as md

__all__ = ["scan_layers", "layer_at", "with_remat", "remat_policy", "REMAT_POLICIES", "NAMES"]

NAMES = md.REMAT_NAMES         # the names remat policies keep values by (einsum results, collectives by kind)
REMAT_POLICIES = md.REMAT_POLICIES


def remat_policy(policy: str):
    """The jax policy for a name of :data:`REMAT_POLICIES`, or for a comma-separated list of value
    names to keep (``"einsum,all-gather"``; names in :data:`NAMES`)."""
    return md.remat_policy(policy)


def with_remat(fn, policy: str = "none"):
    """``fn`` wrapped in ``jax.checkpoint`` with the named policy (``"none"``: unchanged)."""
    rule = remat_policy(policy)
    if policy == "none":
        return fn
    return jax.checkpoint(fn, policy=rule)


def scan_layers(module: nnx.Module, carry, step, *, dim: str = "layers", key=None, remat: str = "none",
                reverse: bool = False, unroll: int = 1, head=None, schedule=None):
    """Run ``step(layer, carry, key) -> (carry, y)`` for each layer of a stacked ``module``.

    Every parameter of ``module`` must have ``dim``. Returns ``(carry, ys)`` with ``ys`` stacked
    along ``dim``. ``key``: per-layer keys ``fold_in(key, l)`` (None: ``step`` gets None).
    ``head`` and ``schedule``: as in ``md.scan`` (then ``(head(carry), ys)``).
    """
    graphdef, state = nnx.split(module)
    length = _stack_length(state, dim)

    def one_layer(layer_state, c, layer_key):
        return step(nnx.merge(graphdef, layer_state), c, layer_key)

    run = one_layer   # md.scan rematerialises the step (remat="auto": the planner's choice)

    if key is None:
        return md.scan(lambda c, s: run(s, c, None), carry, state, dim=dim, reverse=reverse, unroll=unroll,
                       head=head, schedule=schedule, remat=remat)

    def keyed(c, xs):
        s, layer = xs
        # layer.raw: this step's layer number as stored (under a pipeline, the stage's own layer)
        return run(s, c, jax.random.fold_in(key, layer.raw))

    # The layer numbers travel with the layers' parameters, so a layout that splits the layers
    # (a pipeline) hands every stage the numbers of its own layers.
    numbers = md.arange(md.Dim(dim, length))
    return md.scan(keyed, carry, (state, numbers), dim=dim, reverse=reverse, unroll=unroll, head=head,
                   schedule=schedule, remat=remat)


def layer_at(module: nnx.Module, index: int, dim: str = "layers") -> nnx.Module:
    """Layer ``index`` of a stacked ``module`` (its parameters without ``dim``), for Python loops."""
    graphdef, state = nnx.split(module)

    def pick(x):
        if not isinstance(x, md.NamedArray):
            return x
        row = md.take(x, index, dim)
        return md.param(row) if x.is_param else row

    return nnx.merge(graphdef, jax.tree_util.tree_map(pick, state, is_leaf=lambda x: isinstance(x, md.NamedArray)))


def _stack_length(state, dim: str) -> int:
    leaves = jax.tree_util.tree_leaves(state, is_leaf=lambda x: isinstance(x, md.NamedArray))
    sizes = {leaf.dims[dim].size for leaf in leaves if isinstance(leaf, md.NamedArray) and dim in leaf.names}
    if len(sizes) != 1 or any(dim not in leaf.names for leaf in leaves if isinstance(leaf, md.NamedArray)):
        raise md.ShapeError(f"scan_layers: every parameter needs the stack dim {dim!r} with one size; "
                            f"build the layers with stack=md.Dim({dim!r}, n)")
    return sizes.pop()
