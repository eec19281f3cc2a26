"""Property tests: random einsums, renames and layouts reproduce the unsharded reference.

Hypothesis draws a mesh of 8 devices (1-D, 2-D or 3-D), dims and their sizes, operands, the output
dims, and a layout (a dim may go over two mesh axes). A layout that puts two dims of one tensor
on one mesh axis must be refused with a LayoutError; every other layout must give the reference
values, forward and backward. Bounded (see conftest's profile) so the file stays fast.
"""

import itertools

import jax
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import meshdsl as md
from helpers import assert_same

MESHES = [{"data": 2, "model": 4}, {"x": 8}, {"a": 2, "b": 2, "c": 2}]
NAMES = ["p", "q", "r", "s", "t"]


@st.composite
def programs(draw):
    mesh = draw(st.sampled_from(MESHES))
    axes = list(mesh)
    sizes = {n: draw(st.sampled_from([8, 16])) for n in NAMES}
    n_ops = draw(st.integers(1, 3))
    operands = [tuple(draw(st.permutations(NAMES))[: draw(st.integers(1, 3))]) for _ in range(n_ops)]
    union = sorted({n for op in operands for n in op})
    out = tuple(draw(st.permutations(union))[: draw(st.integers(0, len(union)))])
    rules = {}
    for n in NAMES:
        k = draw(st.integers(0, 2 if len(axes) > 1 else 1))
        if k:
            chosen = tuple(draw(st.permutations(axes))[:k])
            if np.prod([mesh[a] for a in chosen]) <= sizes[n]:
                rules[n] = chosen
    return mesh, sizes, operands, out, rules


def valid(dims_list, rules):
    for dims in dims_list:
        used = [a for d in dims for a in rules.get(d, ())]
        if len(used) != len(set(used)):
            return False
    return True


def make_operands(sizes, operands, seed):
    keys = jax.random.split(jax.random.key(seed), len(operands))
    return [md.named(jax.random.normal(k, tuple(sizes[n] for n in op)), " ".join(op))
            for k, op in zip(keys, operands)]


@given(programs(), st.integers(0, 3))
def test_random_einsum_forward_and_gradient(program, seed):
    mesh_axes, sizes, operands, out, rules = program
    xs = make_operands(sizes, operands, seed)
    mesh, layout = md.Mesh(mesh_axes), md.Layout(rules)

    def fn(*xs):
        y = md.einsum(*xs, out=" ".join(out))
        grads = jax.grad(lambda xs: md.sum(md.square(md.einsum(*xs, out=" ".join(out)))).array)(list(xs))
        return md.tanh(y), grads

    f = md.lower(fn, mesh, layout)
    if not valid([*operands, out], rules):
        with pytest.raises(md.LayoutError, match="one mesh axis can split only one dim"):
            f(*xs)
        return
    assert_same(f(*xs), fn(*xs), rtol=2e-4, atol=2e-4)


@given(programs(), st.data())
def test_random_relayouts_through_renames(program, data):
    """A pending sum or split moved to other names (all_to_all / gather / slice / reduce-scatter)."""
    mesh_axes, sizes, operands, out, rules = program
    xs = make_operands(sizes, operands, 0)
    union = sorted({n for op in operands for n in op})
    targets = data.draw(st.permutations([f"{n}2" for n in union]))
    mapping = dict(zip(union, targets))
    extra = {mapping[n]: data.draw(st.sampled_from([(), *[(a,) for a in mesh_axes]])) for n in union}
    mesh, layout = md.Mesh(mesh_axes), md.Layout({**rules, **{k: v for k, v in extra.items() if v}})
    renamed_out = [mapping[n] for n in out]
    for n, axes in extra.items():
        if axes and sizes[{v: k for k, v in mapping.items()}[n]] % mesh_axes[axes[0]]:
            return

    def fn(*xs):
        y = md.einsum(*xs, out=" ".join(out))
        return md.rename(y, {n: mapping[n] for n in out}) if out else y

    f = md.lower(fn, mesh, layout)
    tensors = [*operands, out, renamed_out]
    if not valid(tensors, layout.rules):
        with pytest.raises(md.LayoutError):
            f(*xs)
        return
    assert_same(f(*xs), fn(*xs), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("src, dst", list(itertools.product(
    [(), ("data",), ("model",), ("data", "model"), ("model", "data")], repeat=2)))
def test_every_single_dim_relayout(src, dst):
    """One dim placed over every combination of axes, moved to every other: values unchanged."""
    mesh = md.Mesh({"data": 2, "model": 4})
    x = md.named(jax.random.normal(jax.random.key(0), (16, 8)), "u v")
    layout = md.Layout({"u": src, "w": dst} if src else {"w": dst} if dst else {})
    f = md.lower(lambda x: md.rename(x, {"u": "w"}), mesh, layout)
    out = f(x)
    np.testing.assert_array_equal(np.asarray(out.array), np.asarray(x.array))
