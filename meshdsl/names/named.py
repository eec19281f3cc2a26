"""NamedArray: a jax array whose axes are named dims.

``md.named(array, "batch seq d_model")`` pairs an array with global :class:`Dim` s. Outside
``md.lower`` the array is the whole (global) value; inside, ``x.array`` is this device's block and
``x.placement`` says how the global value is spread over the mesh (which axes split which dim,
and which axes hold pending partial sums). ``md.param`` marks parameters: the mark is static pytree
data, so ``jax.grad`` and optax updates carry it, and the storage layout follows it.

NamedArray is a jax pytree: its only child is the array; dims, the parameter mark and the placement
are static. Operators (``+``, ``*``, ``-x``, comparisons) broadcast by name: :mod:`meshdsl.ops`
installs them. Inside ``md.lower``, ``md.named`` makes a *whole* value (the same on every device);
the active context (:mod:`meshdsl.names.tracing`) places it, and refuses a device's local block.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from .dims import Dim, Shape, parse_dims
from .errors import ShapeError, user_line
from .tracing import current

__all__ = ["NamedArray", "Placement", "Facts", "named", "param", "is_named"]


@dataclasses.dataclass(frozen=True)
class Placement:
    """How a tensor's global value sits on the mesh (inside ``md.lower`` only).

    ``axes[i]``: mesh axes splitting dim ``i`` (major first; ``()`` = whole on every device).
    ``pending``: mesh axes over which the local blocks are partial sums still to be added.
    """

    axes: tuple[tuple[str, ...], ...]
    pending: frozenset = frozenset()

    def split_axes(self) -> frozenset:
        return frozenset(a for axes in self.axes for a in axes)

    def used_axes(self) -> frozenset:
        return self.split_axes() | self.pending

    def sliced_to(self, target) -> bool:
        """Is a block placed by ``target`` (axes per dim) a local slice of this placement's: each
        dim split over the same axes and maybe more, so nothing moves to get it?"""
        return len(target) == len(self.axes) and all(tuple(t[:len(a)]) == tuple(a) for a, t in zip(self.axes, target))

    def of(self, dims, name: str) -> tuple[str, ...]:
        for d, axes in zip(dims, self.axes):
            if d.name == name:
                return axes
        return ()

    def describe(self, dims, mesh=None) -> str:
        """``"batch:data, pending sum over model"``; with the ``mesh``, factor axes are written as
        its axes (:meth:`meshdsl.names.mesh.Mesh.axes_text`)."""
        def text(axes):
            return mesh.axes_text(axes) if mesh is not None else "+".join(axes)
        parts = [f"{d.name}:{text(a)}" for d, a in zip(dims, self.axes) if a]
        if self.pending:
            order = mesh.factor_axes if mesh is not None else sorted(self.pending)
            parts.append("pending sum over " + text([a for a in order if a in self.pending]))
        return ", ".join(parts) or "replicated"


@dataclasses.dataclass(frozen=True)
class Facts:
    """What the rewriter knows of a value inside a lowering beyond its placement, kept on the
    value (a value rebuilt by jax - a pytree round trip, a loop's carry - starts with none):

    * ``made_by``: ``"einsum at model.py:12"``, the op that produced it (for messages);
    * ``weights_only``: computed from parameters and constants alone (no data reaches it);
    * ``narrowed``: computed from an op the planner left unwidened (its readers follow);
    * ``pieces``: ``(dim, ((piece, offset), ...))`` of a value made of pieces along a dim (a pad,
      a concat, a zero-filled shift), zeros elsewhere: a later slice or relayout reads the pieces."""

    made_by: str = ""
    weights_only: bool = False
    narrowed: bool = False
    pieces: tuple | None = None


NO_FACTS = Facts()


class NamedArray:
    """A jax array with named dims. Build one with :func:`named`; ops match dims by name."""

    __slots__ = ("_array", "dims", "is_param", "placement", "facts")
    __array_priority__ = 1000  # numpy scalars defer to our operators

    def __init__(self, array, dims, *, is_param: bool = False, placement: Placement | None = None,
                 facts: Facts = NO_FACTS):
        # No validation here: jax and optax rebuild NamedArrays from children of other shapes.
        self._array = array
        self.dims = dims if isinstance(dims, Shape) else Shape(dims)
        self.is_param = is_param
        self.placement = placement
        self.facts = facts   # the rewriter's facts about it (Facts), not part of its pytree

    # -- the data ----------------------------------------------------------------------------------

    @property
    def array(self):
        """The jax array: the global value outside ``md.lower``; inside, this device's block in its
        current placement, typed exactly: a pending partial sum is reduced first, and a value equal
        on every device of an axis is typed invariant there - so ``jax.grad`` of a scalar loss's
        ``.array`` counts the loss once, not once per device."""
        ctx = current()
        if self.placement is None or ctx is None:
            return self._array
        return ctx.read(self)

    @property
    def raw(self):
        """The array as stored, for lowering rules: the global value outside ``md.lower``; inside,
        this device's block as it is (pending partial sums not yet reduced)."""
        return self._array

    # -- descriptive properties ------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return self.dims.names

    @property
    def shape(self) -> dict[str, int]:
        """Global sizes by name."""
        return {d.name: d.size for d in self.dims}

    @property
    def dtype(self):
        return self._array.dtype

    @property
    def ndim(self) -> int:
        return len(self.dims)

    @property
    def size(self) -> int:
        return int(np.prod([d.size for d in self.dims], dtype=np.int64))

    def dim(self, name: str) -> Dim:
        return self.dims[name]

    def __repr__(self) -> str:
        dt = getattr(self._array, "dtype", "?")
        mark = ", param" if self.is_param else ""
        mesh = getattr(current(), "mesh", None)
        where = f", {self.placement.describe(self.dims, mesh)}" if self.placement is not None else ""
        return f"NamedArray({dt}[{self.dims}]{mark}{where})"

    # Operators (+, *, -x, <, &, ...) and astype() broadcast by name: meshdsl.ops installs them,
    # as jax installs its array methods. display installs _repr_html_.

    __hash__ = object.__hash__  # identity: == is not overloaded (use md.equal)


def _flatten(x: NamedArray):
    return (x._array,), (x.dims, x.is_param, x.placement)


def _flatten_with_keys(x: NamedArray):
    return ((jax.tree_util.GetAttrKey("array"), x._array),), (x.dims, x.is_param, x.placement)


def _unflatten(aux, children):
    dims, is_param, placement = aux
    return NamedArray(children[0], dims, is_param=is_param, placement=placement)


jax.tree_util.register_pytree_with_keys(NamedArray, _flatten_with_keys, _unflatten, _flatten)


def is_named(x) -> bool:
    """Is ``x`` a NamedArray? (the ``is_leaf`` of pytree walks that stop at NamedArrays)"""
    return isinstance(x, NamedArray)


def named(array, dims, *, is_param: bool = False) -> NamedArray:
    """Name the axes of ``array``: ``md.named(x, "batch seq d_model")``.

    Sizes come from the array; sizes written in ``dims`` (``"batch:8"``, Dims) must agree. Inside
    ``md.lower`` the array is taken as a whole value replicated on every device.
    """
    if isinstance(array, NamedArray):
        raise ShapeError(f"md.named at {user_line()}: the value already has dims [{array.dims}]; "
                         "use md.rename or md.reshape to change them")
    if not hasattr(array, "shape") or not hasattr(array, "dtype"):
        array = jnp.asarray(array)
    where = f"md.named at {user_line()}"
    specs = parse_dims(dims, what=where)
    shape = tuple(array.shape)
    if len(specs) != len(shape):
        raise ShapeError(
            f"md.named at {user_line()}: {len(specs)} names {[n for n, _ in specs]} for an array of rank "
            f"{len(shape)} and shape {shape}; give one name per axis")
    out_dims = []
    for (name, size), n in zip(specs, shape):
        if size is not None and size != n:
            raise ShapeError(f"md.named at {user_line()}: dim {name!r} is written with size {size} but the "
                             f"array has size {n} on that axis (shape {shape})")
        out_dims.append(Dim(name, int(n)))
    try:
        dims_ = Shape(out_dims)
    except ShapeError as e:
        raise ShapeError(f"{where}: {e}") from None
    ctx = current()
    placement = None if ctx is None else ctx.adopt(array, dims_, where)
    return NamedArray(array, dims_, is_param=is_param, placement=placement)


def param(x: NamedArray) -> NamedArray:
    """Mark ``x`` as a parameter: stored by the layout's ``params=`` rules, gathered at use."""
    if not isinstance(x, NamedArray):
        raise ShapeError(f"md.param at {user_line()}: expected a NamedArray (md.named(...)), got {type(x).__name__}")
    return NamedArray(x._array, x.dims, is_param=True, placement=x.placement)
