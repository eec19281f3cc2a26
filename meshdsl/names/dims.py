"""Named dimensions: the vocabulary every other module speaks.

A :class:`Dim` is a name and a global size (``Dim("d_model", 512)``). A tensor's shape is a tuple
of Dims, written in Mesh-TF style as a string: ``"batch:8 seq:128"`` (``;`` and ``,`` also
separate). Ops take dims in any of these forms: one name, a string of names (``"batch d_model"``),
a ``Dim``, or a sequence of names/Dims; a size is written ``name:size`` where it cannot be inferred.

Names are identifiers; a layout maps names to mesh axes, so a name means the same thing wherever
it appears, and two dims of one tensor never share a name.

Example:
    >>> import meshdsl as md
    >>> md.Dim("d_model", 512)
    Dim('d_model', 512)
    >>> s = md.shape("batch:8 seq:128")
    >>> s.names, s.sizes
    (('batch', 'seq'), (8, 128))
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Sequence
from typing import Union

import jax

from .errors import ShapeError

__all__ = ["Dim", "Shape", "DimsSpec", "shape", "parse_dims", "parse_names"]

DimsSpec = Union[str, "Dim", Sequence[Union[str, "Dim"]], None]
"""What an op accepts wherever it takes dims: one name (``"d_model"``), a string of names
(``"batch d_model"``, ``;`` and ``,`` also separate, ``name:size`` where a size is needed), a
:class:`Dim`, or a sequence of names and Dims."""


@dataclasses.dataclass(frozen=True)
class Dim:
    """A named dimension: ``name`` (an identifier) and a global ``size`` (an integer >= 0).

    The size is the *global* size: under a layout that splits the dim over mesh axes, each device
    holds ``size / (product of those axes' sizes)`` of it. Dims are values: equal when name and size
    are equal, hashable, and printed ``name:size``.

    Raises:
        ShapeError: the name is not an identifier, or the size is not an integer >= 0.

    Example:
        >>> import meshdsl as md
        >>> d = md.Dim("d_model", 512)
        >>> d.name, d.size, str(d)
        ('d_model', 512, 'd_model:512')
        >>> md.Dim("d model", 512)
        Traceback (most recent call last):
        ...
        meshdsl.names.errors.ShapeError: dim name 'd model' is not an identifier: use letters, digits and _
    """

    name: str
    size: int

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ShapeError(f"dim name {self.name!r} is not an identifier: use letters, digits and _")
        if isinstance(self.size, bool) or not isinstance(self.size, int) or self.size < 0:
            try:
                size = int(self.size)
            except (TypeError, ValueError):
                size = -1
            if size < 0 or size != self.size:
                raise ShapeError(f"dim {self.name!r} has size {self.size!r}: sizes are integers >= 0")
            object.__setattr__(self, "size", size)

    def __str__(self) -> str:
        return f"{self.name}:{self.size}"

    def __repr__(self) -> str:
        return f"Dim({self.name!r}, {self.size})"


class Shape(tuple):
    """A tuple of :class:`Dim` with ``.names`` and ``.sizes``; printed ``batch:8 seq:128``.

    Indexing by a name gives that :class:`Dim`, ``in`` accepts names, and a slice is a Shape.
    Two dims with one name are refused (:class:`ShapeError`).

    Example:
        >>> import meshdsl as md
        >>> s = md.Shape([md.Dim("batch", 8), md.Dim("seq", 128)])
        >>> s["seq"], "batch" in s, s[1:]
        (Dim('seq', 128), True, Shape('seq:128'))
    """

    def __new__(cls, dims: Iterable[Dim] = ()) -> Shape:
        dims = tuple(dims)
        names = [d.name for d in dims]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ShapeError(f"duplicate dim names {dupes} in shape [{' '.join(map(str, dims))}]: "
                             "each dim of a tensor needs its own name (rename one of them)")
        return super().__new__(cls, dims)

    @property
    def names(self) -> tuple[str, ...]:
        """The dim names, in order."""
        return tuple(d.name for d in self)

    @property
    def sizes(self) -> tuple[int, ...]:
        """The global sizes, in order."""
        return tuple(d.size for d in self)

    def __getitem__(self, key):
        if isinstance(key, str):
            for d in self:
                if d.name == key:
                    return d
            raise KeyError(key)
        out = super().__getitem__(key)
        return Shape(out) if isinstance(key, slice) else out

    def __contains__(self, item) -> bool:
        if isinstance(item, str):
            return item in self.names
        return super().__contains__(item)

    def __str__(self) -> str:
        return " ".join(map(str, self))

    def __repr__(self) -> str:
        return f"Shape({str(self)!r})"


# A Shape is static data: registered as a pytree node without children, so jax and flax NNX treat a
# Shape held by a module or passed through a transformation as structure, never as an array leaf.
jax.tree_util.register_pytree_node(Shape, lambda s: ((), tuple(s)), lambda dims, _: Shape(dims))

_SPLIT = re.compile(r"[\s,;]+")


def parse_dims(spec: DimsSpec, *, what: str = "dims") -> list[tuple[str, int | None]]:
    """``spec`` in any accepted form (see :data:`DimsSpec`) -> ``[(name, size or None), ...]``.

    ``what`` starts the message of the :class:`ShapeError` raised for a malformed spec.

    Example:
        >>> from meshdsl.names.dims import Dim, parse_dims
        >>> parse_dims("batch inner:24")
        [('batch', None), ('inner', 24)]
        >>> parse_dims(["batch", Dim("d_model", 512)])
        [('batch', None), ('d_model', 512)]
    """
    if spec is None:
        return []
    if isinstance(spec, Dim):
        return [(spec.name, spec.size)]
    if isinstance(spec, str):
        out = []
        for token in _SPLIT.split(spec.strip()):
            if not token:
                continue
            name, sep, size = token.partition(":")
            if not name.isidentifier():
                raise ShapeError(f"{what}: {name!r} in {spec!r} is not a dim name (an identifier)")
            if sep:
                try:
                    n = int(size)
                except ValueError:
                    raise ShapeError(f"{what}: size {size!r} of {name!r} in {spec!r} is not an "
                                     "integer; write name:size, e.g. d_model:512") from None
                if n < 0:
                    raise ShapeError(f"{what}: size of {name!r} in {spec!r} is negative")
                out.append((name, n))
            else:
                out.append((name, None))
        return out
    if isinstance(spec, Sequence):
        out = []
        for item in spec:
            if isinstance(item, (str, Dim)):
                out.extend(parse_dims(item, what=what))
            else:
                raise ShapeError(f"{what}: {item!r} is neither a dim name nor a Dim")
        return out
    raise ShapeError(f"{what}: {spec!r} is neither a dim name, a string of names, a Dim nor a list")


def parse_names(spec: DimsSpec, *, what: str = "dims") -> tuple[str, ...]:
    """Names only (sizes, if written, are checked by the caller); a name given twice is a ShapeError."""
    names = tuple(name for name, _ in parse_dims(spec, what=what))
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ShapeError(f"{what}: {dupes} named twice in {spec!r}")
    return names


def shape(spec: DimsSpec) -> Shape:
    """A :class:`Shape` from a Mesh-TF style string (or Dims); every size must be written.

    Names and sizes are written ``name:size``, separated by spaces, ``;`` or ``,``.

    Raises:
        ShapeError: a dim without a size, a size that is not an integer, a name written twice.

    Example:
        >>> import meshdsl as md
        >>> md.shape("batch:8 seq:128")
        Shape('batch:8 seq:128')
        >>> md.shape("batch:8;d_model:512") == md.shape("batch:8, d_model:512")
        True
        >>> md.shape("batch seq:128")
        Traceback (most recent call last):
        ...
        meshdsl.names.errors.ShapeError: md.shape('batch seq:128'): 'batch' has no size; write batch:<size>
    """
    dims = []
    for name, size in parse_dims(spec, what="md.shape"):
        if size is None:
            raise ShapeError(f"md.shape({spec!r}): {name!r} has no size; write {name}:<size>")
        dims.append(Dim(name, size))
    return Shape(dims)
