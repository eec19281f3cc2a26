"""The logical mesh: named axes over the devices of all processes.

``md.Mesh({"data": 2, "model": 4})`` arranges ``jax.devices()`` (every process's devices) into a
2 x 4 grid with named axes. A layout maps dim names onto these axes. ``Mesh.abstract(...)`` makes
a mesh of any size without devices: it can be explained (``md.explain``) but not run, which is how
a 512-device layout is costed on a laptop.

Axes are jax ``AxisType.Auto``: the explicit backend makes every axis manual inside ``shard_map``
and the ``gspmd`` backend leaves the choice to the compiler, over the same mesh object.

**Factor axes.** Inside the rewriter every axis is cut into its prime factors, major first: ``x``
of size 8 is the factor axes ``x.0``, ``x.1``, ``x.2`` of size 2 (an axis of prime size is its own
single factor, under its own name). ``Mesh.factor_mesh`` is the jax mesh over those, with the same
devices in the same order, so a dim split over all factors of ``x`` is split exactly as over ``x``.
The factors let a value be split over *part* of an axis: ``d:16`` split over ``x:8`` reshaped to
``p:4 q:4`` is ``p`` over ``x.0, x.1`` and ``q`` over ``x.2`` - every element stays where it is (the
compiler's sub-axes do the same). Users never write factor axes; messages and ``md.explain`` show a
whole axis by its name and a part of one as ``x:(1)4`` (the part of size 4 whose major factors
multiply to 1, Shardy's notation): :meth:`Mesh.axes_text`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import jax
from jax.sharding import AxisType

from .errors import MeshError, suggest

__all__ = ["Mesh", "prime_factors"]


def prime_factors(n: int) -> list[int]:
    """``n``'s prime factors, smallest first (``[]`` for 1)."""
    out, p = [], 2
    while p * p <= n:
        while n % p == 0:
            out.append(p)
            n //= p
        p += 1
    return out + ([n] if n > 1 else [])


def _check_axes(axes) -> dict[str, int]:
    if not isinstance(axes, Mapping) or not axes:
        raise MeshError(f"a mesh is a non-empty dict of axis name -> size, got {axes!r}")
    out = {}
    for name, size in axes.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise MeshError(f"mesh axis name {name!r} is not an identifier")
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise MeshError(f"mesh axis {name!r} has size {size!r}: sizes are integers >= 1")
        out[name] = size
    return out


class Mesh:
    """Named mesh axes over devices: ``Mesh({"data": 2, "model": 4})``.

    Args:
        axes: axis name -> size, major axis first (a dict, or a string as for :meth:`parse`).
            The product of the sizes must equal the number of devices.
        devices: the devices to arrange, in order; default ``jax.devices()`` (every process's).
        platform: ``"cpu"``, ``"gpu"``, ``"tpu"``: picks byte rules of the cost model (default:
            the devices' platform).

    Raises:
        MeshError: an axis name that is not an identifier, a size < 1, or sizes whose product is
            not the number of devices.

    Example:
        >>> import meshdsl as md
        >>> mesh = md.Mesh({"data": 2, "model": 4})  # over 8 devices
        >>> mesh.shape, mesh.size, mesh.axis_names
        ({'data': 2, 'model': 4}, 8, ('data', 'model'))
        >>> str(mesh)
        'data:2 x model:4'
    """

    def __init__(self, axes: Mapping[str, int] | str, devices: Sequence | None = None, *,
                 _abstract: bool = False, platform: str | None = None) -> None:
        if isinstance(axes, str):
            axes = _parse_axes(axes, None if _abstract else _device_count(devices))
        self._axes = _check_axes(axes)
        self._abstract = _abstract
        names, sizes = tuple(self._axes), tuple(self._axes.values())
        self._factor_axes()
        fnames, fsizes = tuple(self._factor_sizes), tuple(self._factor_sizes.values())
        if _abstract:
            self.jax_mesh = jax.sharding.AbstractMesh(sizes, names, axis_types=(AxisType.Auto,) * len(names))
            self.factor_mesh = jax.sharding.AbstractMesh(fsizes, fnames, axis_types=(AxisType.Auto,) * len(fnames))
            self.platform = platform or jax.default_backend()
            return
        devs = list(jax.devices() if devices is None else devices)
        if math.prod(sizes) != len(devs):
            raise MeshError(
                f"mesh {self} has {math.prod(sizes)} devices but {len(devs)} are available "
                f"({'jax.devices()' if devices is None else 'devices='}); choose axis sizes whose "
                f"product is {len(devs)}, or use md.Mesh.abstract(...) to explain a larger mesh")
        self.jax_mesh = jax.make_mesh(sizes, names, axis_types=(AxisType.Auto,) * len(names), devices=devs)
        self.factor_mesh = jax.sharding.Mesh(self.jax_mesh.devices.reshape(fsizes), fnames,
                                             axis_types=(AxisType.Auto,) * len(fnames))
        self.platform = platform or devs[0].platform

    def _factor_axes(self) -> None:
        """Each axis's factor axes (see the module doc): ``self._factors[axis]`` (names, major
        first), ``self._factor_sizes`` (every factor axis, mesh order), ``self._owner`` (factor
        -> (axis, size of the factors before it))."""
        self._factors: dict[str, tuple[str, ...]] = {}
        self._factor_sizes: dict[str, int] = {}
        self._owner: dict[str, tuple[str, int]] = {}
        for name, size in self._axes.items():
            primes = prime_factors(size) or [1]
            names = (name,) if len(primes) == 1 else tuple(f"{name}.{i}" for i in range(len(primes)))
            self._factors[name] = names
            before = 1
            for f, p in zip(names, primes):
                self._factor_sizes[f] = p
                self._owner[f] = (name, before)
                before *= p
        self._factor_order = tuple(self._factor_sizes)
    @classmethod
    def parse(cls, spec: str, devices: Sequence | None = None) -> Mesh:
        """A mesh from ``"data:2;model:4"`` (``,`` and spaces also separate).

        One size may be ``-1``: whatever the other axes leave of the devices.

        Raises:
            MeshError: a malformed entry, an axis written twice, or sizes that do not fit the devices.

        Example:
            >>> import meshdsl as md
            >>> md.Mesh.parse("data:2;model:4")
            Mesh(data:2, model:4)
            >>> md.Mesh.parse("data:-1,model:2")  # 8 devices
            Mesh(data:4, model:2)
        """
        return cls(_parse_axes(spec, _device_count(devices)), devices)

    @classmethod
    def abstract(cls, axes: Mapping[str, int] | str, platform: str | None = None) -> Mesh:
        """A mesh of any size without devices, for ``md.explain``: costs a 512-device layout on a laptop.

        An abstract mesh can be explained but not run. ``platform`` picks the byte rules of the
        cost model (XLA's CPU backend moves bf16 as f32); default: this machine's backend.

        Example:
            >>> import meshdsl as md
            >>> mesh = md.Mesh.abstract({"data": 64, "model": 8})
            >>> mesh, mesh.size, mesh.is_abstract
            (Mesh.abstract(data:64, model:8), 512, True)
            >>> md.Mesh.abstract("data:8", platform="tpu").platform
            'tpu'
        """
        if isinstance(axes, str):
            axes = _parse_axes(axes, None)
        return cls(axes, _abstract=True, platform=platform)

    @property
    def shape(self) -> dict[str, int]:
        """Axis name -> size (a copy)."""
        return dict(self._axes)

    @property
    def axis_names(self) -> tuple[str, ...]:
        """The axis names, major first."""
        return tuple(self._axes)

    @property
    def size(self) -> int:
        """The number of devices: the product of the axis sizes."""
        return math.prod(self._axes.values())

    @property
    def is_abstract(self) -> bool:
        """True for :meth:`abstract` meshes (explain only, never run)."""
        return self._abstract

    def axis_size(self, axis: str) -> int:
        """The size of one axis (or factor axis); MeshError (with a suggestion) for an unknown name."""
        if axis in self._axes:
            return self._axes[axis]
        if axis in self._factor_sizes:
            return self._factor_sizes[axis]
        raise MeshError(f"mesh {self} has no axis {axis!r}{suggest(axis, self._axes)}")

    def axes_size(self, axes: Sequence[str]) -> int:
        """The product of the sizes of ``axes`` (1 for none)."""
        return math.prod(self.axis_size(a) for a in axes)

    # -- factor axes (the rewriter's view, see the module doc) ------------------------------------

    @property
    def factor_axes(self) -> tuple[str, ...]:
        """Every factor axis, in mesh order (major first)."""
        return self._factor_order

    def factors(self, axis: str) -> tuple[str, ...]:
        """The factor axes of ``axis``, major first (``(axis,)`` for a prime size or 1)."""
        return self._factors[axis]

    def expand(self, axes: Sequence[str]) -> tuple[str, ...]:
        """``axes`` (mesh axes) as factor axes, leaving out factors of size 1."""
        return tuple(f for a in axes for f in self._factors[a] if self._factor_sizes[f] != 1)

    def parts(self, axes: Sequence[str]) -> list[tuple[str, int]]:
        """Factor axes as ``(text, size)`` per mesh axis or part of one, in order: a run of
        factors that makes a whole axis is that axis's name, a part of one is written ``x:(1)4``
        (the part of size 4 whose major factors multiply to 1; Shardy's notation)."""
        out: list[tuple[str, int]] = []
        axes = tuple(axes)
        i = 0
        while i < len(axes):
            if axes[i] not in self._owner:   # a mesh axis name itself
                out.append((axes[i], self.axis_size(axes[i])))
                i += 1
                continue
            name, before = self._owner[axes[i]]
            order = self._factors[name]
            run = [axes[i]]
            while i + len(run) < len(axes) and axes[i + len(run)] in order \
                    and order.index(axes[i + len(run)]) == order.index(run[-1]) + 1:
                run.append(axes[i + len(run)])
            size = self.axes_size(run)
            out.append((name if size == self._axes[name] else f"{name}:({before}){size}", size))
            i += len(run)
        return out

    def collapse(self, axes: Sequence[str]) -> tuple[str, ...]:
        """Factor axes as mesh axes where they make whole axes (see :meth:`parts`); the inverse
        of :meth:`expand`."""
        return tuple(text for text, _ in self.parts(axes))

    def axes_text(self, axes: Sequence[str]) -> str:
        """Factor axes for messages: ``"data+model"``, ``"x:(1)4"`` for a part of axis ``x``."""
        return "+".join(self.collapse(axes))

    def __eq__(self, other) -> bool:
        return isinstance(other, Mesh) and self.jax_mesh == other.jax_mesh

    def __hash__(self) -> int:
        return hash(self.jax_mesh)

    def __str__(self) -> str:
        return " x ".join(f"{k}:{v}" for k, v in self._axes.items())

    def __repr__(self) -> str:
        kind = "Mesh.abstract" if self._abstract else "Mesh"
        return f"{kind}({', '.join(f'{k}:{v}' for k, v in self._axes.items())})"


def _device_count(devices) -> int:
    return len(jax.devices()) if devices is None else len(list(devices))


def _parse_axes(spec: str, n_devices: int | None) -> dict[str, int]:
    if not isinstance(spec, str):
        raise MeshError(f"Mesh.parse expects a string like 'data:2;model:4', got {spec!r}; "
                        "pass a dict to md.Mesh(...)")
    axes: dict[str, int] = {}
    for token in re.split(r"[\s,;]+", spec.strip()):
        if not token:
            continue
        name, sep, size = token.partition(":")
        if not sep or not name.isidentifier():
            raise MeshError(f"bad mesh entry {token!r} in {spec!r}: write axis:size, e.g. 'data:2;model:4'")
        if name in axes:
            raise MeshError(f"mesh axis {name!r} appears twice in {spec!r}")
        try:
            axes[name] = int(size)
        except ValueError:
            raise MeshError(f"size {size!r} of mesh axis {name!r} in {spec!r} is not an integer") from None
    for name, size in axes.items():
        if size < 1 and size != -1:
            raise MeshError(f"mesh axis {name!r} has size {size} in {spec!r}: sizes are integers >= 1 "
                            "(or one -1 for the rest of the devices)")
    wild = [k for k, v in axes.items() if v == -1]
    if len(wild) > 1:
        raise MeshError(f"only one mesh axis may have size -1 in {spec!r}")
    if wild:
        if n_devices is None:
            raise MeshError(f"an abstract mesh needs every size written, got {spec!r}")
        rest = math.prod(v for v in axes.values() if v != -1)
        if n_devices % rest:
            raise MeshError(f"cannot fill {wild[0]!r}: {n_devices} devices are not divisible by {rest}")
        axes[wild[0]] = n_devices // rest
    if not axes:
        raise MeshError(f"empty mesh spec {spec!r}")
    return axes
