"""Drawing random programs (hypothesis strategies): a random mesh, layout, storage rules and
``param_gather`` mode, then inputs and up to ``max_steps`` steps of the public ops, each over
values made earlier (:mod:`fuzz_programs` holds the program model and its interpreter)."""

from __future__ import annotations

import itertools
import math

import numpy as np
from hypothesis import strategies as st

from fuzz_programs import (BASE, BINARY, COMPARE, MESHES, MORE_BINARY, MORE_UNARY, OPS, UNARY, Program, Value,
                           size_of)

MAX_ELEMS = 4096
# dims that steps make (merges, splits, top_k outputs), each placed by the drawn layout too
DERIVED = ("m64", "m128", "m256", "m512", "p4", "q4", "p2", "k2", "k4")


def _elems(names):
    return math.prod(size_of(n) for n in names)


def _axes_choice(draw, mesh):
    names = list(mesh)
    options = [(), (), (), ()] + [(a,) for a in names]
    options += list(itertools.permutations(names, 2))   # two axes on one dim, in either order
    if len(names) == 3:
        options += [tuple(names), tuple(reversed(names))]
    return draw(st.sampled_from(options))


@st.composite
def programs(draw, max_steps=6, ops=OPS, allow_invalid=True, dtypes=("float32",)):
    """A random :class:`Program` of ``ops``; its float inputs of one of ``dtypes``."""
    mesh = draw(st.sampled_from(MESHES))
    rng = np.random.default_rng(draw(st.integers(0, 2 ** 31)))
    all_names = list(BASE) + list(DERIVED)
    layout = {}
    for n in all_names:
        axes = _axes_choice(draw, mesh)
        if axes:
            layout[n] = axes
    params = {}
    if draw(st.booleans()):
        for n in draw(st.lists(st.sampled_from(list(BASE)), max_size=2, unique=True)):
            axes = _axes_choice(draw, mesh)
            if axes:
                params[n] = axes
    param_gather = draw(st.sampled_from(["keep", "regather", "auto"]))

    inputs, values = [], []

    def new_input(names, kind="float", is_param=False):
        shape = tuple(size_of(n) for n in names)
        if kind == "float":
            arr = rng.standard_normal(shape).astype(np.float32)
        else:
            arr = rng.integers(-3, 19, shape).astype(np.int32)
        inputs.append((tuple(names), kind, is_param, arr))
        values.append(Value(tuple(names), kind, is_param))
        return len(values) - 1

    base = list(BASE)
    for _ in range(draw(st.integers(1, 3))):
        names = draw(st.lists(st.sampled_from(base), min_size=1, max_size=3, unique=True))
        while _elems(names) > MAX_ELEMS:
            names = names[:-1]
        new_input(names, "float", is_param=draw(st.booleans()))

    for _ in range(draw(st.integers(0, 2))):  # integer ids for take / one_hot (before any step)
        new_input(draw(st.lists(st.sampled_from(["c", "d", "b"]), min_size=1, max_size=2, unique=True)), "int")

    steps = []
    for _ in range(draw(st.integers(1, max_steps))):
        op = draw(st.sampled_from(ops))
        floats = [i for i, v in enumerate(values) if v.kind == "float"]
        made = _step(draw, rng, op, floats, values, new_input, (mesh, layout))
        if made is None:
            continue
        kw, operands, names = made
        steps.append((op, kw, operands))
        keeps_mark = op in ("rename", "reshape") and values[operands[0]].is_param
        values.append(Value(tuple(names), "float", keeps_mark))
    made = [i for i in range(len(inputs), len(values))] or [0]
    outputs = sorted(set(draw(st.lists(st.sampled_from(made), min_size=1, max_size=2))) | {len(values) - 1})
    prog = Program(mesh, layout, params, param_gather, inputs, steps, outputs, values, draw(st.sampled_from(dtypes)))
    if not allow_invalid and not prog.layout_valid():
        from hypothesis import assume
        assume(False)
    return prog


def _step(draw, rng, op, floats, values, new_input, placed=({}, {})):
    # half the time the latest value: chains (rename -> reshape -> cumsum) as well as fan-outs
    pick = lambda: floats[-1] if draw(st.booleans()) else draw(st.sampled_from(floats))  # noqa: E731
    if op == "einsum3":
        i, j, k = pick(), pick(), pick()
        union = list(dict.fromkeys(values[i].names + values[j].names + values[k].names))
        out = [n for n in union if draw(st.booleans())]
        if _elems(union) > 8 * MAX_ELEMS:
            return None
        return {"out": " ".join(out)}, [i, j, k], out
    if op == "scan2":
        i = pick()
        if len(values[i].names) < 2:
            return None
        dim = draw(st.sampled_from(values[i].names))
        return {"dim": dim}, [i], [n for n in values[i].names if n != dim]
    if op == "int_minmax":
        i = pick()
        names = list(values[i].names)
        if not names:
            return None
        first = draw(st.sampled_from(names))
        rest = [n for n in names if n != first]
        second = draw(st.sampled_from(rest)) if rest and draw(st.booleans()) else ""
        return {"first": first, "second": second}, [i], [n for n in rest if n != second]
    if op == "einsum":
        i, j = pick(), pick()
        union = list(dict.fromkeys(values[i].names + values[j].names))
        out = [n for n in union if draw(st.booleans())]
        if _elems(union) > 8 * MAX_ELEMS:
            return None
        return {"out": " ".join(out)}, [i, j], out
    if op in ("binary", "binary2"):
        i, j = pick(), pick()
        names = list(dict.fromkeys(values[i].names + values[j].names))
        if _elems(names) > MAX_ELEMS:
            return None
        return {"f": draw(st.sampled_from(BINARY if op == "binary" else MORE_BINARY))}, [i, j], names
    if op == "compare":
        i, j = pick(), pick()
        names = list(dict.fromkeys(values[i].names + values[j].names))
        if _elems(names) > MAX_ELEMS:
            return None
        return {"f": draw(st.sampled_from(COMPARE))}, [i, j], names
    if op == "transpose":
        i = pick()
        order = list(draw(st.permutations(values[i].names)))
        return {"order": " ".join(order)}, [i], order
    if op == "create":
        i = pick()
        if not values[i].names:
            return None
        return {"f": draw(st.sampled_from(["arange", "full"])), "dim": draw(st.sampled_from(values[i].names))}, \
            [i], values[i].names
    if op in ("dyn_read", "dyn_write"):
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        start = draw(st.one_of(st.integers(0, size_of(dim) - 1), st.integers(-4, size_of(dim) + 4)))  # clamped
        names = values[i].names if op == "dyn_write" else [n for n in values[i].names if n != dim]
        return {"dim": dim, "start": start}, [i], names
    if op == "local_map":
        i = pick()
        if not values[i].names:
            return None
        keep = [n for n in values[i].names[:-1] if draw(st.booleans())]   # never the last (cumsum) dim
        return {"keep": " ".join(keep)}, [i], values[i].names
    if op == "attention":   # queries of two dims or more: a position dim and a feature dim
        wide = [j for j in floats if len(values[j].names) >= 2]
        if not wide:
            return None
        i = wide[-1] if draw(st.booleans()) else draw(st.sampled_from(wide))
        names = list(values[i].names)
        length = draw(st.sampled_from(names))
        feature = draw(st.sampled_from([n for n in names if n != length]))
        same = [j for j in floats if set(values[j].names) == set(names)]
        j, k = draw(st.sampled_from(same)), draw(st.sampled_from(same))
        kw = {"length": length, "features": feature, "causal": draw(st.booleans()),
              "block": draw(st.sampled_from([None, 2, 3]))}
        return kw, [i, j, k], [n for n in names if n != feature] + [feature]
    if op == "scale":
        i = pick()
        return {"c": draw(st.sampled_from([0.5, 2.0, -1.0])), "b": draw(st.sampled_from([0.0, 0.25]))}, [i], values[i].names
    if op in ("unary", "unary2"):
        i = pick()
        return {"f": draw(st.sampled_from(UNARY if op == "unary" else MORE_UNARY))}, [i], values[i].names
    if op == "reduce":
        i = pick()
        names = values[i].names
        dims = [n for n in names if draw(st.booleans())]
        f = draw(st.sampled_from(["sum", "mean", "max", "min"]))
        dtype = draw(st.sampled_from(["float", "float", "int32", "uint32", "uint8", "int8", "bool"])) \
            if f in ("max", "min") else "float"
        if f in ("sum", "mean") and dtype != "float":
            dtype = "float"
        return {"f": f, "dims": " ".join(dims), "dtype": dtype}, [i], [n for n in names if n not in dims] if dims else []
    if op == "softmax":
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        f = draw(st.sampled_from(["softmax", "logsumexp"]))
        return {"f": f, "dim": dim}, [i], values[i].names if f == "softmax" else [n for n in values[i].names if n != dim]
    if op == "rename":
        i = pick()
        names = values[i].names
        if not names:
            return None
        mapping = {}
        for n in names:
            same = [m for m in list(BASE) + list(DERIVED) if size_of(m) == size_of(n) and m != n]
            if same and draw(st.booleans()):
                mapping[n] = draw(st.sampled_from(same))
        new = [mapping.get(n, n) for n in names]
        if len(set(new)) != len(new):  # make it a swap where two collide
            return None
        return {"mapping": mapping}, [i], new
    if op == "reshape":
        i = pick()
        names = list(values[i].names)
        if len(names) >= 2 and draw(st.booleans()):
            k = draw(st.integers(0, len(names) - 2))
            merged = f"m{size_of(names[k]) * size_of(names[k + 1])}"
            if merged in names or merged not in DERIVED:
                return None
            new = names[:k] + [merged] + names[k + 2:]
        else:
            cands = [n for n in names if size_of(n) in (16, 8)]
            if not cands:
                return None
            n = draw(st.sampled_from(cands))
            parts = ["p4", "q4"] if size_of(n) == 16 else ["p2", "q4"]
            if any(p in names for p in parts):
                return None
            k = names.index(n)
            new = names[:k] + parts + names[k + 1:]
        return {"dims": " ".join(f"{n}:{size_of(n)}" for n in new)}, [i], new
    if op in ("take", "one_hot"):
        ints = [i for i, v in enumerate(values) if v.kind == "int"]
        if not ints:
            return None
        ids = draw(st.sampled_from(ints))
        ids_names = list(values[ids].names)
        if op == "one_hot":
            dim = draw(st.sampled_from([n for n in BASE if n not in ids_names]))
            return {"dim": dim}, [ids], ids_names + [dim]
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        rest = [n for n in values[i].names if n != dim]
        if set(ids_names) & set(rest) or _elems(ids_names + rest) > MAX_ELEMS:
            return None
        return {"dim": dim}, [i, ids], ids_names + rest
    if op == "experts":   # each row's top-2 positions along its last dim pick experts of as many
        i = pick()
        names = list(values[i].names)
        if len(names) < 2:
            return None
        pool = [n for n in BASE if n not in names]
        experts = [n for n in pool if size_of(n) == size_of(names[-1])]
        if not experts or len(pool) < 2:
            return None
        e = draw(st.sampled_from(experts))
        hidden = draw(st.sampled_from([n for n in pool if n != e]))
        mesh, layout = placed
        axes = [a for n in (e, names[-1], hidden) for a in layout.get(n, ())]
        if len(axes) != len(set(axes)) or any(size_of(n) % math.prod(mesh[a] for a in layout.get(n, ()))
                                              for n in (e, names[-1], hidden)):
            return None   # its kernels (constants here) would be an invalid tensor under the layout
        return {"experts": e, "hidden": hidden, "gated": draw(st.booleans())}, [i], names
    if op == "top_k":
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        k = draw(st.sampled_from([2, 4]))
        out = f"k{k}"
        if out in values[i].names or k > size_of(dim):
            return None   # k beyond the dim is a user error (a ShapeError), not a program to run
        return {"dim": dim, "k": k, "out": out}, [i], [out if n == dim else n for n in values[i].names]
    if op in ("cumsum", "shift"):
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        if op == "cumsum":
            return {"dim": dim}, [i], values[i].names
        n = size_of(dim)
        wrap = draw(st.booleans())
        lim = 3 * n if wrap else n - 1
        small = min(3, lim)   # a shift by the whole size without wrap is a user error (ShapeError)
        offset = draw(st.one_of(st.integers(-small, small), st.integers(-lim, lim)))
        return {"dim": dim, "offset": offset, "wrap": wrap}, [i], values[i].names
    if op == "concat_slice":
        i = pick()
        same = [j for j in floats if set(values[j].names) == set(values[i].names)]
        j = draw(st.sampled_from(same))
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        start = draw(st.integers(0, size_of(dim)))
        return {"dim": dim, "start": start}, [i, j], values[i].names
    if op == "pad_slice":
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        before = draw(st.integers(0, 8))  # the padded dim stays a multiple of 8: valid wherever the dim is
        after = draw(st.sampled_from([8, 16])) - before
        start = draw(st.integers(0, before + after))
        return {"dim": dim, "before": before, "after": after, "start": start}, [i], values[i].names
    if op == "where":
        i, j, k = pick(), pick(), pick()
        names = list(dict.fromkeys(values[i].names + values[j].names + values[k].names))
        if _elems(names) > MAX_ELEMS:
            return None
        return {"t": 0.0}, [i, j, k], names
    if op == "scan":
        i = pick()
        if not values[i].names:
            return None
        dim = draw(st.sampled_from(values[i].names))
        return {"dim": dim}, [i], [n for n in values[i].names if n != dim]
    if op == "random":
        i = pick()
        return {"f": draw(st.sampled_from(["normal", "uniform", "bernoulli"]))}, [i], values[i].names
    raise AssertionError(op)
