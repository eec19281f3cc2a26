"""The space ``md.search`` enumerates: meshes of a device count, assignments of dims to mesh
axes (one dim, a group of dims no value holds together, or nothing per axis), ZeRO-3 storage
rules, program choices; and the keys under which two layouts cost the same (the same blocks on
the same devices, the same sizes on links alike, the same per-device program).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax

from ..names.errors import MeshDSLError
from ..names.layout import Layout
from ..names.mesh import Mesh, prime_factors
from ..names.named import is_named

__all__ = ["AXIS_NAMES", "dims_of", "meshes", "factorisations", "groups", "layouts", "devices_grouped", "costs_alike",
           "sharing", "zero_rules", "combinations"]

AXIS_NAMES = ("data", "model", "pipe")   # the axes a device count is factorised into (names only)


def dims_of(args, dims, program=None) -> tuple[dict, list, list]:
    """dim name -> size over the arguments' NamedArrays (the sizes must agree) and the dims a
    rename gives them in the program (a model's ``length`` fed by the batch's ``targets``), the
    dims of each parameter, and the **units** a mesh axis splits together: an argument's dim with
    every name renames give it (``targets``, ``length``, ``seq``, ``kv_seq``: the positions, split
    as one - context parallelism; splitting a name alone leaves the others' values whole), where
    no value holds two of them (else each name is a unit of its own). ``dims`` (names of any dim
    the program has) narrows which dims a layout may place, each a unit of its own.
    ``program``: what one shape-only trace saw (:class:`meshdsl.search.floor.Held`: ``sizes`` of
    every dim, ``renamed``: dim -> the names renames gave it, ``dim_sets``: the dims of each value)."""
    sizes, params = {}, []
    for leaf in jax.tree_util.tree_leaves(args, is_leaf=is_named):
        if not is_named(leaf):
            continue
        for d in leaf.dims:
            sizes.setdefault(d.name, d.size)
        if leaf.is_param:
            params.append(tuple((d.name, d.size) for d in leaf.dims))
    if not sizes:
        raise MeshDSLError("md.search: the arguments hold no NamedArray, so there is no dim to place; "
                           "pass the program's inputs and parameters as NamedArrays")
    known = dict(program.sizes) if program is not None else {}
    renamed = program.renamed if program is not None else {}
    held_together = program.dim_sets if program is not None else ()
    units = []
    for root in list(sizes):   # the names renames give the arguments' dims, through chains of renames
        unit, frontier = [root], [root]
        while frontier:
            for new in sorted(renamed.get(frontier.pop(), ())):
                if new not in unit and new in known:
                    sizes.setdefault(new, known[new])
                    unit.append(new)
                    frontier.append(new)
        if len(unit) > 1 and all(sizes[d] == sizes[root] for d in unit) and \
                not any(len(s.intersection(unit)) > 1 for s in held_together):
            units.append(tuple(sorted(unit)))
    if dims is not None:
        dims = [dims] if isinstance(dims, str) else list(dims)
        every = {**known, **sizes}
        unknown = [d for d in dims if d not in every]
        if unknown:
            raise MeshDSLError(f"md.search: dims={unknown} are not dims of the program (it has "
                               f"{sorted(every)}); name dims its values carry")
        return {d: every[d] for d in dims}, params, [(d,) for d in dims]
    together = {d for unit in units for d in unit}
    return sizes, params, units + [(d,) for d in sorted(sizes) if d not in together]


def meshes(mesh_or_count, mesh_axes: int = 2) -> list[Mesh]:
    """The mesh given, or each factorisation of a device count into at most ``mesh_axes`` axes
    (``data:n``, ``data:a x model:b``, ``data:a x model:b x pipe:c``; every size >= 2), concrete
    when the count is the devices jax has, else abstract."""
    if isinstance(mesh_or_count, Mesh):
        return [mesh_or_count]
    n = mesh_or_count
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise MeshDSLError(f"md.search: {n!r} is neither an md.Mesh nor a device count (a positive int)")
    if mesh_axes not in range(1, len(AXIS_NAMES) + 1):
        raise MeshDSLError(f"md.search: mesh_axes={mesh_axes!r}; a device count is factorised into 1 to "
                           f"{len(AXIS_NAMES)} axes ({', '.join(AXIS_NAMES)})")
    shapes = [dict(zip(AXIS_NAMES, sizes)) for k in range(1, mesh_axes + 1) for sizes in factorisations(n, k)]
    concrete = n == jax.device_count()
    return [Mesh(s) if concrete else Mesh.abstract(s) for s in shapes]


def factorisations(n: int, k: int) -> list[tuple]:
    """Ordered ``k``-tuples of sizes >= 2 multiplying to ``n`` (``(n,)`` for one axis, even n = 1)."""
    if k == 1:
        return [(n,)]
    return [(a, *rest) for a in range(2, n) if n % a == 0 for rest in factorisations(n // a, k - 1)
            if all(r >= 2 for r in rest)]


def groups(sizes, dim_sets, params=(), largest: int = 3, units=None, scanned=frozenset()) -> list[tuple]:
    """What one mesh axis may split: nothing, one unit (a dim, or a dim with the names renames
    give it: :func:`dims_of`; default: each dim), or a group of up to ``largest`` parameter dims
    no value of the program holds two of (Megatron's ``heads``, ``d_ff`` and ``vocab`` on one
    axis: tensor parallelism splits weights; ``params``: each parameter's ``(dim, size)``s), and
    none a dim an ``md.scan`` runs over (``scanned``: an axis splitting one is a pipeline's stage
    axis, which splits nothing else); or a data unit with one parameter dim no value holds with it
    (expert parallelism: ``batch`` and ``experts`` on one axis, the tokens sent to their experts)."""
    names = sorted(sizes)
    units = [(d,) for d in names] if units is None else sorted(units)
    weights = sorted({d for p in params for d, _ in p} & set(names) - set(scanned))

    def apart(group):
        return not any(len(s.intersection(group)) > 1 for s in dim_sets)

    out = [(), *units]
    for k in range(2, largest + 1):
        out += [g for g in itertools.combinations(weights, k) if apart(g)]
    out += [(*u, w) for u in units if not set(u) & set(weights) | set(scanned) for w in weights if apart((*u, w))]
    return out


def layouts(mesh, sizes, params, zero, dim_sets=frozenset(), units=None, scanned=frozenset()):
    """``(layout, why pruned or "")`` for every assignment of mesh axes to dims (see the module doc)."""
    axes = list(mesh.shape)
    for choice in itertools.product(groups(sizes, dim_sets, params, units=units, scanned=scanned),
                                    repeat=len(axes)):   # each a distinct layout
        rules = {}
        for axis, group in zip(axes, choice):
            for dim in group:
                rules[dim] = rules.get(dim, ()) + (axis,)
        bad = [f"{d}:{sizes[d]} does not divide by {'+'.join(a)} ({math.prod(mesh.shape[x] for x in a)})"
               for d, a in rules.items() if sizes[d] % math.prod(mesh.shape[x] for x in a)]
        layout = Layout(rules)
        yield layout, ("pruned: " + "; ".join(bad)) if bad else ""
        if zero and not bad:
            stored = zero_rules(mesh, rules, params)
            if stored:
                yield Layout(rules, params=stored), ""


def devices_grouped(mesh, layout) -> tuple:
    """What a layout does to the devices, whatever the mesh's axes are called: per dim (compute
    and storage), the positions of the prime factors of the device index splitting it
    (``d_ff:data`` on ``data:8`` splits d_ff as ``d_ff:data+model`` on ``data:2 x model:4``)."""
    factors, start = [], {}
    for axis, size in mesh.shape.items():
        start[axis] = len(factors)
        factors += prime_factors(size)
    spans = lambda axes: tuple(i for a in axes for i in range(start[a], start[a] + len(prime_factors(mesh.shape[a]))))  # noqa: E731
    return (tuple(factors), tuple(sorted((d, spans(a)) for d, a in layout.rules.items())),
            tuple(sorted((d, spans(a)) for d, a in layout.param_rules.items())))


def costs_alike(mesh, layout, hw) -> tuple:
    """What a layout's cost depends on: per dim (compute and storage), the size of each axis
    splitting it and the link that axis runs on. Two layouts alike here move the same bytes over
    the same links and hold the same blocks (``batch:data;d_ff:model`` on ``data:4 x model:2`` and
    ``d_ff:data;batch:model`` on ``data:2 x model:4`` on one NVLink domain): the second is not
    costed."""
    def split(rules):
        return tuple(sorted((d, tuple(sorted((mesh.shape[a], hw.link(a, mesh)) for a in axes)))
                            for d, axes in rules.items() if axes))
    shared = sharing(layout, lambda a: (mesh.shape[a], hw.link(a, mesh)))
    return "alike", math.prod(mesh.shape.values()), split(layout.rules), split(layout.param_rules), shared


def sharing(layout, sig) -> tuple:
    """Which dims each used axis splits (with the axis's place among each dim's axes, for compute
    and storage), per axis signature ``sig(axis)``, without the axes' names: two layouts alike
    per dim may still differ in which dims share an axis (``heads`` and ``d_ff`` on one)."""
    used = {a for rules in (layout.rules, layout.param_rules) for axes in rules.values() for a in axes}
    return tuple(sorted((sig(a),
                         tuple(sorted((d, axes.index(a)) for d, axes in layout.rules.items() if a in axes)),
                         tuple(sorted((d, axes.index(a)) for d, axes in layout.param_rules.items() if a in axes)))
                        for a in used))


def zero_rules(mesh, rules, params) -> dict:
    """ZeRO-3 storage: each mesh axis some rule uses stores the parameters not computed split over
    it split there too, on one dim per axis: the dim holding the most parameter elements the axis
    divides (a dim's rule is shared by every parameter with that dim, so two dims on one axis
    would put both on it in a parameter holding both). Parameters without that dim stay whole
    over the axis."""
    stored: dict = {}
    for axis in [a for a in mesh.shape if any(a in ax for ax in rules.values())]:
        split = lambda d: math.prod(mesh.shape[a] for a in rules.get(d, ()) + stored.get(d, ()))  # noqa: E731
        elements: dict = {}
        for p in params:
            if any(axis in rules.get(d, ()) + stored.get(d, ()) for d, _ in p):
                continue   # computed or already stored split over it
            for d, size in p:
                if size % (split(d) * mesh.shape[axis]) == 0:
                    elements[d] = elements.get(d, 0) + math.prod(n for _, n in p)
        clash = {d for p in params for d, _ in p
                 if any(axis in rules.get(e, ()) + stored.get(e, ()) for e, _ in p)}   # shares a parameter with the axis
        fits = [(n, d) for d, n in elements.items() if d not in clash]
        if fits:
            d = max(fits)[1]
            stored[d] = stored.get(d, ()) + (axis,)
    return stored


def combinations(choices) -> list[dict]:
    """Every combination of the ``choices`` (name -> values), ``[{}]`` when there are none."""
    if not choices:
        return [{}]
    bad = [k for k, v in choices.items() if isinstance(v, (str, bytes)) or not isinstance(v, Sequence) or not v]
    if bad:
        raise MeshDSLError(f"md.search: choices {bad} must each be a non-empty list of values to try, e.g. "
                           "choices={'remat': ['none', 'full']}")
    names = list(choices)
    return [dict(zip(names, values)) for values in itertools.product(*(choices[n] for n in names))]
