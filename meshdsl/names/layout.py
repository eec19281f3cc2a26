"""Layouts: a function from dim names to mesh axes.

``md.Layout({"batch": "data", "d_ff": "model"})`` says: wherever a tensor has a ``batch`` dim it
is split over mesh axis ``data``; ``d_ff`` over ``model``; every other dim is replicated. A dim may
be split over several axes (``{"batch": ("pod", "data")}``, major axis first). ``params=`` rules
add splits for parameters *at rest* (ZeRO-3 / FSDP: ``params={"d_model": "data"}``); at use the
rewriter gathers them back to the compute layout.

A tensor's placement is therefore a function of its dims. :meth:`Layout.tensor_axes` computes it
and refuses what cannot mean what was written: two dims of one tensor on one axis, a size the axes
do not divide, an axis the mesh lacks.

Example:
    >>> import meshdsl as md
    >>> layout = md.Layout.parse("batch:data;d_ff:model")
    >>> layout.axes("batch"), layout.axes("d_model")
    (('data',), ())
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Union

from jax.sharding import PartitionSpec

from .errors import LayoutError, suggest

if TYPE_CHECKING:
    from .dims import Dim
    from .mesh import Mesh

__all__ = ["Layout", "register_padding_hint"]

Axes = tuple[str, ...]
AxisRule = Union[str, Sequence[str], None]  # one rule's value: an axis, axes (major first), or None


def _as_axes(dim: str, value, where: str) -> Axes:
    if value is None:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (tuple, list)):
        raise LayoutError(f"{where}: rule for {dim!r} must be a mesh axis name or a tuple of them, got {value!r}")
    axes = tuple(value)
    for a in axes:
        if not isinstance(a, str) or not a.isidentifier():
            raise LayoutError(f"{where}: {a!r} in the rule for {dim!r} is not a mesh axis name")
    dupes = sorted({a for a in axes if axes.count(a) > 1})
    if dupes:
        raise LayoutError(f"{where}: dim {dim!r} maps to mesh axis {dupes[0]!r} twice in {axes}; "
                          "list each axis once")
    return axes


def _check_rules(rules, where: str) -> dict[str, Axes]:
    if rules is None:
        return {}
    if isinstance(rules, Layout):
        return dict(rules.rules)
    if not isinstance(rules, dict):
        raise LayoutError(f"{where}: expected a dict of dim name -> mesh axes, got {rules!r}")
    out = {}
    for dim, value in rules.items():
        if not isinstance(dim, str) or not dim.isidentifier():
            raise LayoutError(f"{where}: {dim!r} is not a dim name (an identifier)")
        out[dim] = _as_axes(dim, value, where)
    return out


class Layout:
    """Dim name -> mesh axes: ``Layout({"batch": "data", "d_ff": "model"}, params={"d_model": "data"})``.

    Args:
        rules: dim name -> one mesh axis name, or a tuple of them (major first), or ``None``
            (replicated). A string is read as by :meth:`parse`. Dims without a rule are replicated.
        params: storage-only rules for parameters (:func:`meshdsl.param`) at rest, listing only the
            axes *added* to the compute rule (ZeRO-3 / FSDP: ``{"d_model": "data"}``).
        microbatches: ``{dim: M}`` - a pipeline (an ``md.scan`` over a dim the layout splits) cuts
            its carry into ``M`` microbatches along ``dim``.
        offload: what lives in host memory between steps (:data:`OFFLOAD`): ``"optimizer"``, the
            optimizer state (split as its parameter is stored), brought to the device for the
            update and back each step (MaxText's ``optimizer_memory_host_offload``); ``"params"``,
            the parameters (as stored), streamed to the device where they are used - inside an
            ``md.scan`` one layer at a time - their gradients returned to host memory, and the
            update run on the device, one parameter at a time (``parameter_memory_host_offload``).

    Raises:
        LayoutError: a rule that is not a mesh axis name or tuple of them, an axis listed twice for
            one dim, or a ``params`` rule that repeats an axis of its compute rule. Axes are checked
            against a mesh when the layout meets one (:meth:`check_mesh`, :func:`meshdsl.lower`).

    Example:
        >>> import meshdsl as md
        >>> layout = md.Layout({"batch": ("pod", "data"), "d_ff": "model"}, params={"d_model": "data"})
        >>> layout
        Layout('batch:pod+data;d_ff:model | params d_model:data')
        >>> layout.storage_axes("d_model"), layout.axes("d_model")
        (('data',), ())
        >>> layout == md.Layout.parse("batch:pod+data;d_ff:model", params="d_model:data")
        True
    """

    def __init__(self, rules: Mapping[str, AxisRule] | str | Layout | None = None,
                 params: Mapping[str, AxisRule] | str | Layout | None = None,
                 microbatches: Mapping[str, int] | None = None, offload: str | Sequence[str] = ()) -> None:
        if isinstance(rules, str):
            rules = _parse_rules(rules, "md.Layout")
        if isinstance(params, str):
            params = _parse_rules(params, "md.Layout params")
        self.rules: dict[str, Axes] = _check_rules(rules, "md.Layout")
        self.param_rules: dict[str, Axes] = _check_rules(params, "md.Layout params")
        self.microbatches: dict[str, int] = _check_microbatches(microbatches)
        self.offload: frozenset[str] = _check_offload(offload)
        for dim, extra in self.param_rules.items():
            both = set(extra) & set(self.rules.get(dim, ()))
            if both:
                raise LayoutError(f"md.Layout: params rule for {dim!r} repeats mesh axis {sorted(both)[0]!r} "
                                  "of its compute rule; a params rule lists only the extra axes to store it over")

    @classmethod
    def parse(cls, spec: str, params: str | Mapping[str, AxisRule] | None = None) -> Layout:
        """A layout from ``"batch:data;d_ff:model"``; several axes as ``batch:pod+data`` or ``batch:(pod,data)``.

        Entries are separated by ``;`` (or ``,`` / newlines outside parentheses). ``params`` takes
        the storage rules in the same form.

        Raises:
            LayoutError: an entry that is not ``dim:axes``, or a dim with two entries.

        Example:
            >>> import meshdsl as md
            >>> md.Layout.parse("batch:pod+data;d_ff:model")
            Layout('batch:pod+data;d_ff:model')
            >>> md.Layout.parse("batch:(pod,data)") == md.Layout({"batch": ("pod", "data")})
            True
            >>> md.Layout.parse("batch=data")
            Traceback (most recent call last):
            ...
            meshdsl.names.errors.LayoutError: md.Layout.parse: cannot read 'batch=data' in 'batch=data'; ...
        """
        return cls(_parse_rules(spec, "md.Layout.parse"), params)

    # -- queries ---------------------------------------------------------------------------------

    def axes(self, dim: str) -> Axes:
        """Mesh axes that split ``dim`` in computation, major first (``()`` = replicated).

        Example:
            >>> import meshdsl as md
            >>> layout = md.Layout({"batch": ("pod", "data"), "d_ff": "model"})
            >>> layout.axes("batch"), layout.axes("d_ff"), layout.axes("seq")
            (('pod', 'data'), ('model',), ())
        """
        return self.rules.get(dim, ())

    def storage_axes(self, dim: str) -> Axes:
        """Mesh axes that split ``dim`` of a parameter at rest: compute axes, then ``params=`` axes."""
        return self.rules.get(dim, ()) + self.param_rules.get(dim, ())

    def mesh_axes(self) -> set[str]:
        """Every mesh axis some rule (compute or storage) names."""
        return {a for axes in (*self.rules.values(), *self.param_rules.values()) for a in axes}

    def dim_names(self) -> set[str]:
        """Every dim name some rule (compute or storage) names."""
        return set(self.rules) | set(self.param_rules)

    def check_mesh(self, mesh: Mesh) -> None:
        """Every axis a rule names must exist in ``mesh``: a typo is never silently ignored."""
        for kind, table in (("rule", self.rules), ("params rule", self.param_rules)):
            for dim, axes in table.items():
                for a in axes:
                    if a not in mesh.shape:
                        raise LayoutError(
                            f"layout {kind} {dim}:{'+'.join(axes)} names mesh axis {a!r}, but mesh {mesh} "
                            f"has axes {list(mesh.shape)}{suggest(a, mesh.shape)}; fix the rule or the mesh")

    def tensor_axes(self, dims: Sequence[Dim], mesh: Mesh, *, storage: bool = False,
                    what: str = "tensor") -> tuple[Axes, ...]:
        """Per dim of ``dims``, the mesh axes splitting it; LayoutError if that is impossible.

        ``storage=True`` places a parameter at rest (compute axes, then ``params=`` axes). ``what``
        starts the error message (the op and source line, when the caller knows them).

        Example:
            >>> import meshdsl as md
            >>> mesh = md.Mesh.abstract({"data": 2, "model": 4})
            >>> layout = md.Layout({"batch": "data", "d_ff": "model"})
            >>> layout.tensor_axes(md.shape("batch:8 d_ff:64"), mesh)
            (('data',), ('model',))
            >>> layout.tensor_axes(md.shape("batch:8 d_ff:6"), mesh)
            Traceback (most recent call last):
            ...
            meshdsl.names.errors.LayoutError: tensor [batch:8 d_ff:6]: dim 'd_ff' of size 6 is split over model(4) = 4 devices, which does not divide 6; make 'd_ff' a multiple of 4 or change its layout rule
        """
        if storage:
            check_axes(dims, tuple(self.axes(d.name) for d in dims), mesh, what=what)
            out = tuple(self.storage_axes(d.name) for d in dims)
            try:
                check_axes(dims, out, mesh, what=what)
            except LayoutError as e:
                rules = ", ".join(f"{d.name}:{'+'.join(self.param_rules[d.name])}" for d in dims
                                  if d.name in self.param_rules)
                raise LayoutError(f"{e} (as stored: the params rules {rules} add these splits; store the "
                                  "parameter over other mesh axes)") from None
            return out
        out = tuple(self.axes(d.name) for d in dims)
        check_axes(dims, out, mesh, what=what)
        return out

    def spec(self, dims: Sequence[Dim], mesh: Mesh, *, storage: bool = False) -> PartitionSpec:
        """The jax ``PartitionSpec`` of a tensor with ``dims`` (see :meth:`tensor_axes`)."""
        return to_spec(self.tensor_axes(dims, mesh, storage=storage))

    # -- value semantics -------------------------------------------------------------------------

    def _key(self):
        return (tuple(sorted(self.rules.items())), tuple(sorted(self.param_rules.items())),
                tuple(sorted(self.microbatches.items())), tuple(sorted(self.offload)))

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __str__(self) -> str:
        def fmt(table):
            return ";".join(f"{d}:{'+'.join(a) if a else '-'}" for d, a in table.items())
        out = fmt(self.rules)
        out += f" | params {fmt(self.param_rules)}" if self.param_rules else ""
        micro = ";".join(f"{d}:{m}" for d, m in self.microbatches.items())
        out += f" | microbatches {micro}" if micro else ""
        return out + (f" | offload {','.join(sorted(self.offload))}" if self.offload else "")

    def __repr__(self) -> str:
        return f"Layout({str(self)!r})"


OFFLOAD = ("optimizer", "params")   # what a layout may keep in host memory between steps


def _check_offload(offload) -> frozenset[str]:
    """``"optimizer"``, ``"params"`` or a sequence of names of :data:`OFFLOAD`."""
    names = [offload] if isinstance(offload, str) else list(offload or ())
    for name in names:
        if name not in OFFLOAD:
            raise LayoutError(f"md.Layout: offload names {name!r}; what a layout can keep in host memory is "
                              f"{list(OFFLOAD)} (activations: a remat policy, md.scan(..., remat=\"offload\"))")
    return frozenset(names)


def _check_microbatches(micro) -> dict[str, int]:
    """``{"batch": 8}``: a pipeline (a scan over a split dim) cuts its carry into 8 microbatches
    along ``batch``."""
    if micro is None:
        return {}
    if not isinstance(micro, dict) or len(micro) > 1:
        raise LayoutError(f"md.Layout: microbatches must be a dict of one dim name -> count, e.g. "
                          f"{{'batch': 8}}, got {micro!r}")
    for dim, m in micro.items():
        if not isinstance(dim, str) or not dim.isidentifier():
            raise LayoutError(f"md.Layout: microbatches names {dim!r}, which is not a dim name")
        if isinstance(m, bool) or not isinstance(m, int) or m < 1:
            raise LayoutError(f"md.Layout: microbatches {dim}:{m!r} must be a count >= 1")
    return dict(micro)


def to_spec(axes_per_dim) -> PartitionSpec:
    """A jax PartitionSpec (trailing replicated dims left out, as jax writes specs)."""
    entries = [None if not a else (a[0] if len(a) == 1 else tuple(a)) for a in axes_per_dim]
    while entries and entries[-1] is None:
        entries.pop()
    return PartitionSpec(*entries)


def mesh_spec(mesh, axes_per_dim) -> PartitionSpec:
    """The PartitionSpec over ``mesh.jax_mesh`` (mesh axes) of a placement in factor axes; every
    dim must be split over whole mesh axes (as the layout places values)."""
    out = [mesh.collapse(axes) for axes in axes_per_dim]
    if any(a not in mesh.shape for axes in out for a in axes):
        raise ValueError(f"placement {[mesh.axes_text(a) for a in axes_per_dim]} splits a dim over part of a mesh axis")
    return to_spec(out)


def effective(axes_per_dim, mesh) -> tuple:
    """The factor axes (:mod:`meshdsl.names.mesh`) that really split each dim, as the rewriter places
    values: a mesh axis of size 1 splits nothing, so ``('y', 'x')`` with ``y`` of size 1 places a
    dim exactly as ``('x',)`` does (validity is checked before, on the layout as written)."""
    return tuple(mesh.expand(axes) for axes in axes_per_dim)


def describe_axes(axes: Axes, mesh) -> str:
    return "+".join(f"{text}({size})" for text, size in mesh.parts(axes))


#: dim name -> how its program pads it: a text, or a function of the devices that must divide it
_PADDING_HINTS: dict = {}


def register_padding_hint(dim: str, hint) -> None:
    """Say in the error for a split that does not divide ``dim`` which option pads it: ``hint`` is
    a text or a function ``(devices) -> text``. The core knows no model; a library that pads a dim
    registers its option at import (``meshdsl.models``: ``vocab``, its configs' ``vocab_multiple``)."""
    _PADDING_HINTS[dim] = hint


def _padding_hint(dim: str, devices: int) -> str:
    hint = _PADDING_HINTS.get(dim)
    if hint is None:
        return ""
    return f" ({hint(devices) if callable(hint) else hint})"


def check_axes(dims, axes_per_dim, mesh, *, what: str) -> None:
    """LayoutError unless each mesh axis splits at most one dim and every split size divides."""
    owner: dict[str, str] = {}
    shape_txt = "[" + " ".join(map(str, dims)) + "]"
    for d, axes in zip(dims, axes_per_dim):
        for a in axes:
            if a not in mesh.shape and a not in mesh.factor_axes:
                raise LayoutError(f"{what} {shape_txt}: dim {d.name!r} is mapped to mesh axis {a!r}, "
                                  f"which mesh {mesh} lacks{suggest(a, mesh.shape)}")
            if a in owner:
                raise LayoutError(
                    f"{what} {shape_txt} puts both {owner[a]!r} and {d.name!r} on mesh axis "
                    f"{mesh.axes_text((a,))!r} (size {mesh.axis_size(a)}); one mesh axis can split only one dim of a tensor: map one of "
                    f"them to another axis, or rename one dim so the rule does not apply to it")
            owner[a] = d.name
        n = mesh.axes_size(axes)
        if d.size % n:
            raise LayoutError(
                f"{what} {shape_txt}: dim {d.name!r} of size {d.size} is split over {describe_axes(axes, mesh)} "
                f"= {n} devices, which does not divide {d.size}; make {d.name!r} a multiple of {n} or "
                f"change its layout rule{_padding_hint(d.name, n)}")


_RULE = re.compile(r"^\s*([A-Za-z_]\w*)\s*:\s*(.+?)\s*$")


def _split_entries(spec: str) -> list[str]:
    entries, depth, cur = [], 0, []
    for c in spec:
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        if c in ";,\n" and depth == 0:
            entries.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    entries.append("".join(cur))
    return [e for e in (x.strip() for x in entries) if e]


def _parse_rules(spec: str, where: str) -> dict[str, Axes]:
    if not isinstance(spec, str):
        raise LayoutError(f"{where}: expected a string like 'batch:data;d_ff:model', got {spec!r}")
    rules: dict[str, Axes] = {}
    for entry in _split_entries(spec):
        m = _RULE.match(entry)
        if not m:
            raise LayoutError(f"{where}: cannot read {entry!r} in {spec!r}; write dim:axis entries separated "
                              "by ';', e.g. 'batch:data;d_ff:model' (several axes: 'batch:pod+data')")
        dim, value = m.group(1), m.group(2)
        if value.startswith("(") and value.endswith(")"):
            value = value[1:-1]
        if ":" in value:
            raise LayoutError(f"{where}: {entry!r} in {spec!r} does not name mesh axes; several axes are "
                              f"written {dim}:{value.replace(':', '+')}")
        axes = [a.strip() for a in re.split(r"[+,]", value)]
        if not axes or any(not a.isidentifier() for a in axes):
            raise LayoutError(f"{where}: {entry!r} in {spec!r} does not name mesh axes (an empty or bad axis "
                              f"name); write dim:axis, e.g. {dim}:data, or {dim}:axis1+axis2")
        if dim in rules:
            raise LayoutError(f"{where}: dim {dim!r} has two rules in {spec!r}; give it one (several axes: "
                              f"'{dim}:a+b')")
        rules[dim] = _as_axes(dim, tuple(axes), where)
    return rules
