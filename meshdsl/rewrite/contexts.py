"""The two contexts without a rewriter: the unsharded reference and the ``gspmd`` backend.

* :class:`GlobalContext` - outside ``md.lower``: every dim whole, no communication. This is the
  unsharded reference every layout must reproduce. Rules see it when :func:`meshdsl.names.tracing.current`
  is ``None`` (:func:`active` returns the shared :data:`GLOBAL`).
* :class:`GspmdContext` - ``backend="gspmd"``: global arrays plus one sharding constraint per op
  output; the compiler chooses the communication. The baseline benchmarks compare against.

The rewriter's context is :class:`meshdsl.rewrite.explicit.ExplicitContext`. All three implement
:class:`meshdsl.names.tracing.LoweringContext`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from jax.sharding import NamedSharding

from . import collectives as C
from . import param_gather
from ..names.layout import check_axes, effective, mesh_spec
from ..names.named import NamedArray, is_named
from ..platform.jaxcompat import differentiated, host_resident, line_scope, to_memory
from .recorder import Recorder
from ..names.tracing import current

__all__ = ["GlobalContext", "DimsRecorder", "Work", "LayoutContext", "GspmdContext", "GLOBAL", "active"]


class GlobalContext:
    """Whole arrays, nothing to place, nothing to communicate."""

    explicit = False
    mesh = None
    layout = None
    params = param_gather.KEEP

    def __init__(self):
        self.rec = Recorder(self.mesh)

    @property
    def op(self):
        """(name, user line) of the outermost named op being lowered, or ``None``."""
        return self.rec.op

    def at(self, name: str, line: str):
        return self.rec.at(name, line)

    def fetch(self, array):
        """``array`` (kept in host memory: offloaded parameters) brought to the device, under the
        name scope of the line of the op using it (explain lists the transfer there)."""
        with line_scope(self.op[1] if self.op else "?"):
            return to_memory(array, "device")

    def apply(self, name: str, rule, args, kwargs):
        """Run the rule of the outermost op ``name`` (the explicit backend may plan it)."""
        return rule(self, *args, **kwargs)

    def option(self, count: int) -> int:
        """Which of ``count`` candidates a rule's decision point takes (0: the rule's own)."""
        return 0

    def whole_placement(self, dims):
        return None

    def placement(self, x: NamedArray):
        return None

    def pending(self, x: NamedArray) -> frozenset:
        return frozenset()

    def plan(self, dims, operands, *, prefer=(), keep_pending=frozenset(), cheapest=False, out_dtype=None):
        return {d.name: () for d in dims}

    def vary(self, planned, operands=(), keep_pending=frozenset(), out_size=None):
        return frozenset()

    def relaid(self, x: NamedArray, target) -> bool:
        """Is a copy of ``x`` placed by ``target`` (axes per dim) already made? (explicit only)"""
        return False

    def result_relaid(self, operands, target) -> bool:
        """Will the result of the op at hand be relaid to ``target`` later? (explicit only)"""
        return False

    def pieces(self, y: NamedArray, name: str, pieces) -> NamedArray:
        """``y`` is made of ``pieces`` ((operand, offset) along ``name``; zeros elsewhere): a pad or
        a concat. The explicit context remembers it, so a slice of ``y`` reads the pieces
        directly. Returns ``y``."""
        return y

    def part(self, array, dims, like: NamedArray) -> NamedArray:
        """A part of an op's result that is no result itself (the rows a shift keeps, for
        :meth:`pieces`), placed as ``like`` is, dim by dim."""
        return NamedArray(array, dims)

    def padded_from(self, y: NamedArray):
        """``(name, pieces)`` if ``y`` was made of pieces along ``name``, else None."""
        return None

    def derived(self, operands, result) -> None:
        """An op made ``result`` from ``operands`` (NamedArray leaves): the explicit context
        remembers results computed from parameters and constants alone."""

    def local(self, x: NamedArray, axes_by_name=None, vary=frozenset(), *, keep_pending=frozenset()):
        return self.fetch(x.raw) if host_resident(x.raw) else x.raw   # (offloaded parameters)

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        return NamedArray(array, dims, is_param=is_param)

    def axes_size(self, axes) -> int:
        return 1

    def layout_axes(self, name: str) -> tuple:
        return ()

    def read(self, x: NamedArray):
        return self.fetch(x.raw) if host_resident(x.raw) else x.raw

    def adopt(self, array, dims, where: str):
        return None

    def operand(self, x: NamedArray) -> NamedArray:
        """An op's NamedArray operand as the op sees it (inside a pipeline: this microbatch's rows
        of a value the step captured whole)."""
        return x

    def block_start(self, name: str, size: int, split, block: int):
        """Global index of the first entry of this device's block of dim ``name`` (of ``size``,
        split over ``split`` in blocks of ``block``): what new tensors (``arange``, random numbers)
        number their entries from, so that every layout draws the same values."""
        return C.axis_index(split) * block if split else 0

    def same_rows(self, old, new) -> None:
        """Dim ``new`` holds the rows of dim ``old`` in the same order (a rename, or a reshape's
        leading dim of a merge or split): inside a pipeline, a microbatch's rows of ``new`` are
        numbered within the whole batch too. Nothing to do outside one."""

    def position_extent(self, name: str, size: int) -> int:
        """The size of dim ``name`` that positions count in (inside a pipeline: a microbatch's
        rows are numbered within the whole batch)."""
        return size

    def where(self) -> str:
        """``"einsum at model.py:12"`` for the op being lowered (for messages)."""
        return f"{self.op[0]} at {self.op[1]}" if self.op else "tensor"


GLOBAL = GlobalContext()


def active():
    """The context rules run in: the innermost ``md.lower``'s, or :data:`GLOBAL` outside."""
    ctx = current()
    return GLOBAL if ctx is None else ctx


@dataclasses.dataclass(frozen=True)
class Work:
    """A contraction the unsharded program computes (:class:`DimsRecorder`): the dims it runs over
    (name -> size), its forward FLOPs at least, whether it is differentiated (its backward at
    least twice those), ``"matmul"`` or ``"attention"``, and its operands' dtype."""

    dims: dict
    flops: float
    grad: bool
    kind: str
    dtype: str


class DimsRecorder(GlobalContext):
    """The unsharded reference that also notes the dims of every value a named op returns
    (``dim_sets``): which dims share a tensor, so a layout must not split them over one axis;
    ``shapes``: shape -> the dims (names, in order) of the values of that shape; ``renamed``:
    dim -> the names a rename gave it; ``scanned``: the dims an ``md.scan`` runs over (a layout
    splitting one makes a pipeline); ``reshaped``: dim -> the dims a reshape
    made of it or it of; ``work``: the contractions it computes (:class:`Work`), what a layout
    splits of which bounds its compute per device from below (:mod:`meshdsl.search.floor`)."""

    def __init__(self):
        super().__init__()
        self.dim_sets: set = set()
        self.shapes: dict = {}
        self.renamed: dict = {}
        self.reshaped: dict = {}     # dim -> the dims a reshape made of it, or it of (both ways)
        self.scanned: set = set()     # the dims an md.scan runs over (a layout splitting one: a pipeline)
        self.work: list = []         # Work: the contractions the program computes, whole
        self._loops: list = []       # (dim, size, differentiated) of the md.scan bodies traced now
        self.remat_auto = False      # an md.scan leaves its remat policy to the planner

    def apply(self, name: str, rule, args, kwargs):
        self._note(name, rule, args, kwargs)
        loop = self._loop(rule, args) if name == "scan" else None
        self.remat_auto = self.remat_auto or getattr(rule, "remat", None) == "auto"
        if loop is not None:
            self._loops.append(loop)
        try:
            result = rule(self, *args, **kwargs)
        finally:
            if loop is not None:
                self._loops.pop()
        for leaf in jax.tree_util.tree_leaves(result, is_leaf=is_named):
            if is_named(leaf):
                self.dim_sets.add(frozenset(d.name for d in leaf.dims))
                self.shapes.setdefault(tuple(d.size for d in leaf.dims), set()).add(tuple(d.name for d in leaf.dims))
        if name in ("einsum", "attention"):
            self._work(name, args, kwargs, result)
        elif name == "reshape" and is_named(result):
            before = {n for x in args if is_named(x) for n in x.names}
            gone, made = before - set(result.names), set(result.names) - before
            for d in gone | made:
                self.reshaped.setdefault(d, set()).update((gone | made) - {d})
        return result

    def _loop(self, rule, args):
        """``(dim, size, differentiated)`` of a ``md.scan`` about to trace its body (``args``: its
        carry and xs leaves); jax differentiates the body after tracing it, so the body's work is
        differentiated where the loop's operands are."""
        dim = getattr(rule, "dim", None)
        leaves = [x for x in jax.tree_util.tree_leaves(args, is_leaf=is_named) if is_named(x)]
        sizes = {x.dims[dim].size for x in leaves if dim in x.names}
        if dim is None or len(sizes) != 1:
            return None
        grad = any(differentiated(x.raw) for x in leaves) or any(g for _, _, g in self._loops)
        return dim, sizes.pop(), grad

    def _work(self, name, args, kwargs, result) -> None:
        """Note the matmul FLOPs an einsum of two operands that contracts a dim, or an attention,
        computes at least (the dims only one operand has and the result lacks summed first, as
        jnp.einsum does; a causal attention's masked half not counted), over which dims, in a
        loop body as often as the loop runs and over its dim too."""
        xs = [x for x in args if is_named(x)]
        if not is_named(result) or len(xs) < 2 or any(not jax.numpy.issubdtype(x.dtype, jax.numpy.inexact) for x in xs):
            return
        sizes = {d.name: d.size for x in xs for d in x.dims}
        out = set(result.names)
        shared = set(xs[0].names).intersection(*(x.names for x in xs[1:]))
        if name == "einsum":
            if len(xs) != 2 or not shared - out:
                return   # a product without a contraction is elementwise; three at once: not bounded here
            dims = {n: s for n, s in sizes.items() if n in shared or n in out}
            flops, kind = 2.0 * math.prod(dims.values()), "matmul"
        else:
            q, k = xs[:2]
            over = kwargs.get("over", "kv_length")
            if over not in k.names:
                return
            features = (set(q.names) & set(k.names)) - out
            rows = math.prod(s for n, s in ((d.name, d.size) for d in q.dims) if n not in features)
            d_k = math.prod(sizes[n] for n in features)
            d_v = max(1, math.prod(d.size for d in result.dims) // max(1, rows))
            pairs = rows * k.dims[over].size * (0.5 if kwargs.get("causal") else 1.0)
            dims = {n: sizes[n] for n in set(q.names) | set(k.names)}
            flops, kind = 2.0 * pairs * (d_k + d_v), "attention"
        grad = any(differentiated(x.raw) for x in xs) or any(g for _, _, g in self._loops)
        for dim, size, _ in self._loops:
            dims[dim] = size
            flops *= size
        dtype = jax.numpy.result_type(*[x.dtype for x in xs[:2]])
        self.work.append(Work(dims, flops, grad, kind, str(dtype)))

    def _note(self, name, rule, args, kwargs) -> None:
        if name == "rename" and len(args) >= 2:
            mapping = args[1] if isinstance(args[1], dict) else {args[1]: args[2]} if len(args) > 2 else {}
            for old, new in mapping.items():
                self.renamed.setdefault(old, set()).add(new)
        elif name == "scan" and getattr(rule, "dim", None):
            self.scanned.add(rule.dim)


class LayoutContext(GlobalContext):
    """A context with a mesh and a layout: the base of the gspmd and explicit backends."""

    def __init__(self, mesh, layout):
        self.mesh, self.layout = mesh, layout
        super().__init__()
        self.dims_seen: set[str] = set()   # every dim name the program used (typo check of rules)
        self._checked: dict = {}

    def layout_axes(self, name: str) -> tuple:
        return effective((self.layout.axes(name),), self.mesh)[0]

    def canonical(self, dims) -> tuple:
        """The layout's axes per dim of ``dims``; LayoutError (naming the op) if impossible."""
        hit = self._checked.get(dims)
        if hit is None:
            hit = tuple(self.layout.axes(d.name) for d in dims)
            check_axes(dims, hit, self.mesh, what=f"{self.where()}: result")
            hit = self._checked[dims] = effective(hit, self.mesh)
        return hit


class GspmdContext(LayoutContext):
    """Global arrays under ``jax.jit``; each op output is constrained to the layout."""

    def adopt(self, array, dims, where: str):
        self.dims_seen.update(dims.names)
        return None

    def out(self, array, dims, axes_by_name=None, pending=frozenset(), *, is_param=False) -> NamedArray:
        x = NamedArray(array, dims, is_param=is_param)
        self.dims_seen.update(x.names)
        axes = self.canonical(x.dims)
        if any(axes):
            sharding = NamedSharding(self.mesh.jax_mesh, mesh_spec(self.mesh, axes))
            constrained = jax.lax.with_sharding_constraint(array, sharding)
            x = NamedArray(constrained, x.dims, is_param=is_param)
        return x
