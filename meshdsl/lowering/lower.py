"""``md.lower``: turn a named program and a layout into a compiled, sharded jax function.

``f = md.lower(fn, mesh, layout)`` returns a callable that behaves like ``jax.jit(fn)``:

* arguments are pytrees of global NamedArrays (flax NNX modules included); other leaves (jax
  arrays, PRNG keys, scalars) are replicated. Each NamedArray is placed by the layout (parameters
  by the storage rules): already-placed inputs are not copied;
* it is traced and compiled once per input structure and shapes;
* outputs are global NamedArrays laid out by the layout (parameter-marked outputs, such as
  gradients of parameters, by the storage rules);
* it can be called inside another ``jax.jit``, differentiated (``jax.grad`` around it), and
  lowered (``f.lower(*args)`` gives the jax ``Lowered``; ``.compile().as_text()`` the HLO).

``backend="explicit"`` (default) runs ``fn`` inside ``shard_map`` over every mesh axis with an
:class:`~meshdsl.rewrite.explicit.ExplicitContext`: the rewriter decides every collective. ``backend="gspmd"``
runs ``fn`` on global arrays with one sharding constraint per op output and lets XLA decide: the
baseline the explicit backend is measured against.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from ..names.errors import LayoutError, MeshDSLError, MeshError, ShapeError, suggest
from ..costmodel.hardware import PROFILES, Hardware
from ..names.layout import Layout
from ..names.mesh import Mesh
from ..names.named import NamedArray, is_named
from ..platform.jaxcompat import HOST_MEMORY
from ..ops.attention import STRATEGIES as ATTENTION
from ..ops.pipeline import SCHEDULES
from ..rewrite.param_gather import POLICIES
from ..planner.plan import OBJECTIVES
from .program import Program
from ..names.units import parse_bytes

__all__ = ["lower", "LoweredFunction", "place"]

BACKENDS = ("explicit", "gspmd")
UNUSED_RULES = ("allow", "error")
PARAM_GATHER = tuple(POLICIES)


def _put(a, sharding):
    """device_put, also for PRNG key arrays onto a sharding spanning other processes' devices
    (which jax refuses for keys: move the key data and wrap it again)."""
    if (isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            and not sharding.is_fully_addressable):
        return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(a), sharding),
                                        impl=jax.random.key_impl(a))
    return jax.device_put(a, sharding)


def _one_of(option: str, value, choices) -> None:
    """MeshDSLError unless ``value`` is one of ``choices``, naming the option and the nearest choice."""
    if value not in choices:
        raise MeshDSLError(f"md.lower: {option} must be one of {choices}, got {value!r}{suggest(str(value), choices)}")


def _budget(memory_budget) -> float | None:
    """``memory_budget`` in bytes per device (a number or text such as ``"12GiB"``), or None."""
    if memory_budget is None:
        return None
    try:
        budget = parse_bytes(memory_budget)
    except (TypeError, ValueError) as e:
        raise MeshDSLError(f"md.lower: memory_budget: {e}") from None
    if not budget > 0:
        raise MeshDSLError(f"md.lower: memory_budget must be a positive number of bytes per device "
                           f"(or text such as '12GiB'), got {memory_budget!r}")
    return budget


class LoweredFunction:
    """A named program compiled for a mesh and a layout (see :func:`lower`)."""

    def __init__(self, fn, mesh: Mesh, layout: Layout, backend: str = "explicit", param_gather: str = "keep",
                 schedule: str = "gpipe", repeats: int = 1, planner: bool = True, attention: str | None = None,
                 unused_rules: str = "allow", objective: str = "time", hardware=None, memory_budget=None):
        if not isinstance(mesh, Mesh):
            raise MeshError(f"md.lower: mesh must be an md.Mesh, got {type(mesh).__name__}; "
                            "build one with md.Mesh({'data': 2, 'model': 4}) or md.Mesh.parse('data:2;model:4')")
        if not isinstance(layout, Layout):
            hint = f"; use md.Layout.parse({layout!r})" if isinstance(layout, str) else \
                "; use md.Layout({'batch': 'data'})"
            raise LayoutError(f"md.lower: layout must be an md.Layout, got {type(layout).__name__}{hint}")
        _one_of("backend", backend, BACKENDS)
        _one_of("param_gather", param_gather, PARAM_GATHER)
        _one_of("schedule", schedule, SCHEDULES)
        if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
            raise MeshDSLError(f"md.lower: repeats must be a positive int (the circular schedule's chunks per "
                               f"stage), got {repeats!r}")
        if repeats > 1 and schedule != "circular":
            raise MeshDSLError(f"md.lower: repeats={repeats} is the circular schedule's; pass "
                               f"schedule='circular' (schedule is {schedule!r})")
        if attention is not None and attention not in ATTENTION:
            raise MeshDSLError(f"md.lower: attention must be one of {ATTENTION} (or None: the planner "
                               f"chooses), got {attention!r}{suggest(str(attention), ATTENTION)}")
        _one_of("unused_rules", unused_rules, UNUSED_RULES)
        _one_of("objective", objective, OBJECTIVES)
        if hardware is not None and not isinstance(hardware, (str, Hardware)):
            raise MeshDSLError(f"md.lower: hardware must be an md.Hardware or a profile's name "
                               f"({', '.join(PROFILES)}), got {type(hardware).__name__}")
        self.memory_budget = _budget(memory_budget)
        layout.check_mesh(mesh)
        self.fn, self.mesh, self.layout = fn, mesh, layout
        self.attention, self.unused_rules = attention, unused_rules
        self.objective, self.hardware = objective, Hardware.of(hardware, mesh)
        self.backend, self.param_gather, self.schedule, self.repeats = backend, param_gather, schedule, repeats
        self.planner = bool(planner)
        self._programs: dict = {}  # input signature -> Program

    def _program(self, args):
        leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=is_named)
        sig = []
        for leaf in leaves:
            if is_named(leaf):
                sig.append((leaf.dims, leaf.is_param, tuple(leaf.raw.shape), str(leaf.raw.dtype)))
            else:
                a = leaf if hasattr(leaf, "shape") else jnp.asarray(leaf)
                sig.append((tuple(a.shape), str(a.dtype)))
        key = (treedef, tuple(sig))
        prog = self._programs.get(key)
        if prog is None:
            for k, leaf in enumerate(leaves):
                if is_named(leaf) and tuple(leaf.raw.shape) != leaf.dims.sizes:
                    raise ShapeError(f"md.lower: argument {k} [{leaf.dims}] holds an array of shape "
                                     f"{tuple(leaf.raw.shape)}; pass global arrays (the whole value)")
            prog = self._programs[key] = Program(self, treedef, leaves)
        return prog, leaves

    def _arrays(self, prog, leaves, place: bool):
        arrays = [leaf.raw if is_named(leaf) else leaf for leaf in leaves]
        if not place:   # (to lower: a parameter the layout offloads is lowered as it will enter, in host memory)
            return [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s) if host and not isinstance(a, jax.core.Tracer)
                    else a for a, s, host in zip(arrays, getattr(prog, "shardings", [None] * len(arrays)), prog.host)]
        return [a if isinstance(a, (jax.core.Tracer, jax.ShapeDtypeStruct)) else _put(a, s)
                for a, s in zip(arrays, prog.shardings)]

    def _check_concrete(self, what: str):
        if self.mesh.is_abstract:
            raise MeshError(f"{self.mesh!r} has no devices: it can be explained (md.explain), not {what}")

    def __call__(self, *args):
        self._check_concrete("run")
        prog, leaves = self._program(args)
        arrays = self._arrays(prog, leaves, True)
        traced = any(isinstance(a, jax.core.Tracer) for a in arrays)
        run = prog.jitted(arrays) if traced or prog.compiled is None else prog.compiled
        return prog.rebuild(run(*arrays))

    def compile(self, *args):
        """The compiled executable for these arguments; later calls with them reuse it (no second
        compilation after inspecting the HLO)."""
        self._check_concrete("compiled")
        prog, leaves = self._program(args)
        if prog.compiled is None:
            arrays = self._arrays(prog, leaves, False)
            prog.compiled = prog.jitted(arrays).lower(*arrays).compile()
        return prog.compiled

    def lower(self, *args):
        """The jax ``Lowered`` for these arguments (``.compile().as_text()`` is the HLO)."""
        self._check_concrete("lowered or run")
        prog, leaves = self._program(args)
        arrays = self._arrays(prog, leaves, False)
        return prog.jitted(arrays).lower(*arrays)

    def trace(self, *args):
        """Trace without compiling: ``(closed jaxpr, explicit context, program)``."""
        prog, leaves = self._program(args)
        return prog.make_jaxpr(prog.avals(self._arrays(prog, leaves, False))), prog.last_ctx, prog

    def __repr__(self) -> str:
        return f"md.lower({getattr(self.fn, '__name__', self.fn)!r}, {self.mesh!r}, {self.layout!r}, backend={self.backend!r})"


def lower(fn, mesh: Mesh, layout: Layout, backend: str = "explicit", *, param_gather: str = "keep",
          schedule: str = "gpipe", repeats: int = 1, planner: bool = True,
          attention: str | None = None, unused_rules: str = "allow", objective: str = "time",
          hardware=None, memory_budget=None) -> LoweredFunction:
    """Compile ``fn`` (a function of NamedArrays) for ``mesh`` and ``layout``.

    ``param_gather`` says what happens to parameters stored split (``params=`` rules) where an op
    needs them whole: ``"keep"`` (ZeRO-3 as written) all-gathers them and keeps the gathered value
    inside ``md.scan`` for the backward pass; ``"regather"`` gathers them again there (ZeRO-3's
    memory saving); ``"auto"`` leaves both choices to the plan, by the step's time under
    ``memory_budget``: whether to gather a parameter or leave it as stored and move the
    activations (an embedding table looked up or a logits projection of a small batch stays put:
    its ids, rows and logits move instead), and, inside ``md.scan``, whether to keep each gathered
    parameter for the backward pass or gather it again there.

    ``schedule``: how an ``md.scan`` over a dim the layout splits (``layers: pipe``) is pipelined
    (microbatches from ``md.Layout(..., microbatches={"batch": M})``): ``"gpipe"``, ``"1f1b"``
    (:mod:`meshdsl.ops.pipeline_1f1b`), or ``"circular"`` with ``repeats=R`` chunks per stage
    (:mod:`meshdsl.ops.pipeline_circular`).

    ``planner``: choose placements over the whole program by cost (:mod:`meshdsl.planner`: a
    shape-only trace records every op's candidates, a solver picks the plan, and the program
    follows it); ``False`` lowers op by op (for comparison).

    ``objective``: what the plan minimises: ``"time"`` (default), the step's predicted time on
    ``hardware`` - the bytes each collective moves and each op's compute per device, so a plan
    that replicates work a layout split pays for it; ``"bytes"``, the bytes moved alone (the plan
    is followed only where it moves fewer than each op's own choice). ``hardware``: an
    ``md.Hardware`` or a profile's name (default: a profile of the mesh's platform, ``cpu``,
    ``h100-80gb`` on a GPU, ``tpu-v5p`` on a TPU). ``memory_budget``: bytes per device (a number
    or text such as ``"12GiB"``) the program's peak may hold: the solver takes the best plan by
    ``objective`` whose memory fits (a constraint at each point of the program), and the traced
    program's peak (``md.explain(...).memory``) is checked against it; a LayoutError where no plan
    fits, naming the least peak found.

    ``attention``: how ``md.attention`` reaches keys split like its queries (context parallelism,
    :mod:`meshdsl.ops.attention`): ``"gather"``, ``"ring"`` or ``"ulysses"``; None (default): the
    planner's choice by bytes.

    ``unused_rules``: a rule (compute or ``params=``) for a dim the program never has is allowed
    (``"allow"``, default: one layout shared by several programs), unless it looks like a typo of
    one of its dims; ``"error"``: every rule must match a dim of the program (a LayoutError
    listing its dims), e.g. ``heads: model`` on a model whose attention dim is ``kv_heads``.
    """
    return LoweredFunction(fn, mesh, layout, backend, param_gather, schedule, repeats, planner, attention,
                           unused_rules, objective, hardware, memory_budget)


def place(tree, mesh: Mesh, layout: Layout):
    """Put every NamedArray of ``tree`` on ``mesh`` as ``layout`` places it (parameters by the
    storage rules); other leaves are replicated. Already-placed arrays are not copied."""
    layout.check_mesh(mesh)

    def put(leaf):
        if is_named(leaf):
            spec = layout.spec(leaf.dims, mesh, storage=leaf.is_param)
            host = HOST_MEMORY if leaf.is_param and "params" in layout.offload else None
            return NamedArray(jax.device_put(leaf.raw, NamedSharding(mesh.jax_mesh, spec, memory_kind=host)),
                              leaf.dims, is_param=leaf.is_param)
        return jax.device_put(leaf, NamedSharding(mesh.jax_mesh, PartitionSpec()))

    return jax.tree_util.tree_map(put, tree, is_leaf=is_named)
