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
:class:`~meshdsl.context.ExplicitContext`: the rewriter decides every collective. ``backend="gspmd"``
runs ``fn`` on global arrays with one sharding constraint per op output and lets XLA decide: the
baseline the explicit backend is measured against.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from . import collectives as C
from .context import ExplicitContext, GspmdContext, using, varying_axes
from .errors import LayoutError, MeshDSLError, MeshError, ShapeError, suggest
from .layout import Layout, to_spec
from .mesh import Mesh
from .named import NamedArray, Placement
from .placement import decide_gathers

__all__ = ["lower", "LoweredFunction", "place"]

BACKENDS = ("explicit", "gspmd")
PARAM_GATHER = ("keep", "regather", "auto")


def _is_named(x) -> bool:
    return isinstance(x, NamedArray)


@dataclasses.dataclass
class _Leaf:
    named: bool
    dims: object = None
    is_param: bool = False
    axes: tuple = ()
    spec: PartitionSpec = PartitionSpec()


class _Entry:
    """One compiled variant: a fixed input structure, its placements, and the jitted function."""

    def __init__(self, owner: LoweredFunction, treedef, leaves):
        self.owner, self.treedef = owner, treedef
        mesh, layout = owner.mesh, owner.layout
        self.infos = []
        for k, leaf in enumerate(leaves):
            if _is_named(leaf):
                axes = layout.tensor_axes(leaf.dims, mesh, storage=leaf.is_param,
                                          what=f"argument {k} ({'parameter' if leaf.is_param else 'input'})")
                self.infos.append(_Leaf(True, leaf.dims, leaf.is_param, axes, to_spec(axes)))
            else:
                self.infos.append(_Leaf(False))
        self.out_specs: list = []
        self.out_tree = None
        self.out_templates: list = []
        self.last_ctx = None
        self.traces = 0
        self.compiled = None
        if not mesh.is_abstract:
            self.shardings = [NamedSharding(mesh.jax_mesh, i.spec) for i in self.infos]
            self.jitted = jax.jit(self.run, in_shardings=self.shardings)

    # -- the traced program ----------------------------------------------------------------------

    def run(self, *arrays):
        self.traces += 1
        owner = self.owner
        if owner.backend == "gspmd":
            return self._run_gspmd(arrays)
        plan = self._gather_plan(arrays) if owner.param_gather == "auto" else None
        return self._smap(functools.partial(self._body, gather_plan=plan), self.out_specs)(*arrays)

    def _smap(self, body, out_specs):
        """``body`` over local blocks; ``out_specs`` is a list the body fills while it is traced."""
        return jax.shard_map(body, mesh=self.owner.mesh.jax_mesh, in_specs=tuple(i.spec for i in self.infos),
                             out_specs=out_specs, check_vma=True)

    def _gather_plan(self, arrays) -> list:
        """``param_gather="auto"``: trace once (shapes only) to collect what gathering or not
        gathering each stored parameter costs, and decide per parameter."""
        probe, specs = [], []
        smap = self._smap(functools.partial(self._body, probe=probe, out_specs=specs), specs)
        jax.eval_shape(smap, *[jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays])
        return decide_gathers(probe)

    def _args(self, arrays, explicit: bool):
        leaves = [NamedArray(a, i.dims, is_param=i.is_param, placement=Placement(i.axes) if explicit else None)
                  if i.named else a for a, i in zip(arrays, self.infos)]
        return jax.tree_util.tree_unflatten(self.treedef, leaves)

    def _body(self, *arrays, gather_plan=None, probe=None, out_specs=None):
        owner = self.owner
        ctx = ExplicitContext(owner.mesh, owner.layout, param_gather=owner.param_gather)
        if probe is None:
            self.last_ctx = ctx
            ctx.gather_plan = None if gather_plan is None else list(gather_plan)
        else:
            ctx.gather_probe = probe
        ctx.dims_seen.update(n for i in self.infos if i.named for n in i.dims.names)
        ctx.param_axes = frozenset(a for i in self.infos if i.named and not i.is_param for ax in i.axes for a in ax)
        with using(ctx):
            out = owner.fn(*self._args(arrays, True))
            leaves, self.out_tree = jax.tree_util.tree_flatten(out, is_leaf=_is_named)
            results, specs, self.out_templates = [], [], []
            ctx.op = ("output", "return value")
            for k, leaf in enumerate(leaves):
                if _is_named(leaf):
                    axes = owner.layout.tensor_axes(leaf.dims, owner.mesh, storage=leaf.is_param,
                                                    what=f"output {k}")
                    results.append(finalize(ctx, leaf, axes))
                    specs.append(to_spec(axes))
                    self.out_templates.append((leaf.dims, leaf.is_param))
                else:
                    arr = jnp.asarray(leaf)
                    if varying_axes(arr):
                        raise LayoutError(
                            f"output {k} is a plain jax array that differs between devices (it varies over "
                            f"{sorted(varying_axes(arr))}); return NamedArrays so the layout can place them")
                    results.append(arr)
                    specs.append(PartitionSpec())
                    self.out_templates.append(None)
            ctx.op = None
            _check_unused_rules(owner.layout, ctx.dims_seen)
        ctx.tracing = False
        if ctx.gather_plan:
            raise AssertionError(f"internal: {len(ctx.gather_plan)} parameter-gather decisions left unused")
        (self.out_specs if probe is None else out_specs)[:] = specs
        return results

    def _run_gspmd(self, arrays):
        owner = self.owner
        ctx = GspmdContext(owner.mesh, owner.layout)
        ctx.dims_seen.update(n for i in self.infos if i.named for n in i.dims.names)
        with using(ctx):
            out = owner.fn(*self._args(arrays, False))
            leaves, self.out_tree = jax.tree_util.tree_flatten(out, is_leaf=_is_named)
            results, self.out_templates = [], []
            for k, leaf in enumerate(leaves):
                if _is_named(leaf):
                    spec = owner.layout.spec(leaf.dims, owner.mesh, storage=leaf.is_param)
                    results.append(jax.lax.with_sharding_constraint(
                        leaf._array, NamedSharding(owner.mesh.jax_mesh, spec)))
                    self.out_templates.append((leaf.dims, leaf.is_param))
                else:
                    results.append(jnp.asarray(leaf))
                    self.out_templates.append(None)
            _check_unused_rules(owner.layout, ctx.dims_seen)
        return results

    def rebuild(self, arrays):
        leaves = [a if t is None else NamedArray(a, t[0], is_param=t[1]) for a, t in zip(arrays, self.out_templates)]
        return jax.tree_util.tree_unflatten(self.out_tree, leaves)


def _put(a, sharding):
    """device_put, also for PRNG key arrays onto a sharding spanning other processes' devices
    (which jax refuses for keys: move the key data and wrap it again)."""
    if (isinstance(a, jax.Array) and jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
            and not sharding.is_fully_addressable):
        return jax.random.wrap_key_data(jax.device_put(jax.random.key_data(a), sharding),
                                        impl=jax.random.key_impl(a))
    return jax.device_put(a, sharding)


def finalize(ctx, leaf, axes):
    """``leaf``'s local block placed by ``axes``, pending sums reduced, and typed invariant
    wherever it is replicated (a value equal on every device that jax types varying - computed from
    parameters cast for a data-parallel op - is typed invariant with one all-reduce)."""
    target = dict(zip(leaf.names, axes))
    split = frozenset(a for ax in axes for a in ax)
    arr = ctx.local(leaf, target, split)
    extra = tuple(a for a in ctx.mesh.axis_names if a in varying_axes(arr) - split)
    if extra:
        arr = ctx.cached(arr, ("replicate", extra), lambda: C.replicate(
            ctx, arr, extra, f"[{leaf.dims}] replicated value typed varying over {list(extra)}"))
    return arr


def _check_unused_rules(layout: Layout, seen: set) -> None:
    """A rule for a dim the program never has is fine (a shared layout), unless it looks like a
    typo of a dim the program has and the layout does not place: it would be silently ignored."""
    unplaced = seen - layout.dim_names()
    for dim in sorted(layout.dim_names() - seen):
        hint = suggest(dim, unplaced, cutoff=0.8)
        if hint:
            raise LayoutError(f"layout rule for {dim!r} matches no dim of the program{hint}; "
                              f"fix the dim name in the layout")


class LoweredFunction:
    """A named program compiled for a mesh and a layout (see :func:`lower`)."""

    def __init__(self, fn, mesh: Mesh, layout: Layout, backend: str = "explicit", param_gather: str = "keep"):
        if not isinstance(mesh, Mesh):
            raise MeshError(f"md.lower: mesh must be an md.Mesh, got {type(mesh).__name__}; "
                            "build one with md.Mesh({'data': 2, 'model': 4}) or md.Mesh.parse('data:2;model:4')")
        if not isinstance(layout, Layout):
            hint = f"; use md.Layout.parse({layout!r})" if isinstance(layout, str) else \
                "; use md.Layout({'batch': 'data'})"
            raise LayoutError(f"md.lower: layout must be an md.Layout, got {type(layout).__name__}{hint}")
        if backend not in BACKENDS:
            raise MeshDSLError(f"md.lower: backend must be one of {BACKENDS}, got {backend!r}"
                               f"{suggest(str(backend), BACKENDS)}")
        if param_gather not in PARAM_GATHER:
            raise MeshDSLError(f"md.lower: param_gather must be one of {PARAM_GATHER}, got {param_gather!r}"
                               f"{suggest(str(param_gather), PARAM_GATHER)}")
        layout.check_mesh(mesh)
        self.fn, self.mesh, self.layout = fn, mesh, layout
        self.backend, self.param_gather = backend, param_gather
        self._entries: dict = {}

    def _entry(self, args):
        leaves, treedef = jax.tree_util.tree_flatten(args, is_leaf=_is_named)
        sig = []
        for leaf in leaves:
            if _is_named(leaf):
                sig.append((leaf.dims, leaf.is_param, tuple(leaf._array.shape), str(leaf._array.dtype)))
            else:
                a = leaf if hasattr(leaf, "shape") else jnp.asarray(leaf)
                sig.append((tuple(a.shape), str(a.dtype)))
        key = (treedef, tuple(sig))
        entry = self._entries.get(key)
        if entry is None:
            for k, leaf in enumerate(leaves):
                if _is_named(leaf) and tuple(leaf._array.shape) != leaf.dims.sizes:
                    raise ShapeError(f"md.lower: argument {k} [{leaf.dims}] holds an array of shape "
                                     f"{tuple(leaf._array.shape)}; pass global arrays (the whole value)")
            entry = self._entries[key] = _Entry(self, treedef, leaves)
        return entry, leaves

    def _arrays(self, entry, leaves, place: bool):
        arrays = [leaf._array if _is_named(leaf) else leaf for leaf in leaves]
        if not place:
            return arrays
        return [a if isinstance(a, (jax.core.Tracer, jax.ShapeDtypeStruct)) else _put(a, s)
                for a, s in zip(arrays, entry.shardings)]

    def _check_concrete(self, what: str):
        if self.mesh.is_abstract:
            raise MeshError(f"{self.mesh!r} has no devices: it can be explained (md.explain), not {what}")

    def __call__(self, *args):
        self._check_concrete("run")
        entry, leaves = self._entry(args)
        arrays = self._arrays(entry, leaves, True)
        traced = any(isinstance(a, jax.core.Tracer) for a in arrays)
        run = entry.jitted if traced or entry.compiled is None else entry.compiled
        return entry.rebuild(run(*arrays))

    def compile(self, *args):
        """The compiled executable for these arguments; later calls with them reuse it (no second
        compilation after inspecting the HLO)."""
        self._check_concrete("compiled")
        entry, leaves = self._entry(args)
        if entry.compiled is None:
            entry.compiled = entry.jitted.lower(*self._arrays(entry, leaves, False)).compile()
        return entry.compiled

    def lower(self, *args):
        """The jax ``Lowered`` for these arguments (``.compile().as_text()`` is the HLO)."""
        self._check_concrete("lowered or run")
        entry, leaves = self._entry(args)
        return entry.jitted.lower(*self._arrays(entry, leaves, False))

    def trace(self, *args):
        """Trace without compiling: ``(closed jaxpr, explicit context, entry)``."""
        entry, leaves = self._entry(args)
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in self._arrays(entry, leaves, False)]
        jaxpr = jax.make_jaxpr(entry.run)(*avals)
        return jaxpr, entry.last_ctx, entry

    def __repr__(self) -> str:
        return f"md.lower({getattr(self.fn, '__name__', self.fn)!r}, {self.mesh!r}, {self.layout!r}, backend={self.backend!r})"


def lower(fn, mesh: Mesh, layout: Layout, backend: str = "explicit", *, param_gather: str = "keep") -> LoweredFunction:
    """Compile ``fn`` (a function of NamedArrays) for ``mesh`` and ``layout``.

    ``param_gather`` says what happens to parameters stored split (``params=`` rules) where an op
    needs them whole: ``"keep"`` (ZeRO-3 as written) all-gathers them and keeps the gathered value
    inside ``md.scan`` for the backward pass; ``"regather"`` gathers them again there (ZeRO-3's
    memory saving); ``"auto"`` gathers a parameter only where that moves fewer bytes than leaving
    it as stored and moving the activations (an embedding table looked up or a logits projection
    of a small batch stays put: its ids, rows and logits move instead).
    """
    return LoweredFunction(fn, mesh, layout, backend, param_gather)


def place(tree, mesh: Mesh, layout: Layout):
    """Put every NamedArray of ``tree`` on ``mesh`` as ``layout`` places it (parameters by the
    storage rules); other leaves are replicated. Already-placed arrays are not copied."""
    layout.check_mesh(mesh)

    def put(leaf):
        if _is_named(leaf):
            spec = layout.spec(leaf.dims, mesh, storage=leaf.is_param)
            return NamedArray(jax.device_put(leaf._array, NamedSharding(mesh.jax_mesh, spec)), leaf.dims,
                              is_param=leaf.is_param)
        return jax.device_put(leaf, NamedSharding(mesh.jax_mesh, PartitionSpec()))

    return jax.tree_util.tree_map(put, tree, is_leaf=_is_named)
