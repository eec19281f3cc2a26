"""General redistribution by ppermute rounds (meshdsl/rewrite/redistribute.py): random moves between two
placements of one tensor (a rename to dims the layout places elsewhere) give the unsharded values
and gradients, md.explain's bytes equal the compiled program's, and never more than gspmd's."""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import meshdsl as md
from meshdsl.costmodel import hlo_comm
from meshdsl.rewrite import redistribute

from helpers import assert_same

MESHES = [{"x": 2, "y": 4}, {"x": 4, "y": 2}, {"x": 2, "y": 2, "z": 2}]


def _placements(draw, mesh, dims):
    """Each mesh axis splits one of ``dims`` or none, in a random order per dim."""
    out = {d: [] for d in dims}
    for a in draw(st.permutations(list(mesh))):
        d = draw(st.sampled_from(dims + [None]))
        if d is not None:
            out[d].append(a)
    return {d: tuple(v) for d, v in out.items() if v}


@st.composite
def moves(draw):
    mesh = draw(st.sampled_from(MESHES))
    sizes = draw(st.lists(st.sampled_from([8, 16]), min_size=2, max_size=3))
    src, dst = ["a", "b", "c"][:len(sizes)], ["p", "q", "r"][:len(sizes)]
    order = draw(st.permutations(range(len(sizes))))   # the renamed dims, in another order too
    layout = {**_placements(draw, mesh, src), **_placements(draw, mesh, dst)}
    return mesh, sizes, src, [dst[k] for k in order], layout


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(moves())
def test_random_moves_equal_unsharded_and_explained(move):
    mesh, sizes, src, dst, rules = move
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(sizes), jnp.float32), " ".join(src))
    fn = lambda x: md.rename(x, dict(zip(src, dst)))
    weight = md.named(jnp.asarray(np.random.default_rng(1).standard_normal(sizes), jnp.float32), " ".join(dst))
    grad = lambda x: jax.grad(lambda x: md.sum(md.sin(fn(x)) * weight).array)(x)
    m, layout = md.Mesh(mesh), md.Layout(rules)
    for f in (fn, grad):
        assert_same(md.lower(f, m, layout)(x), f(x), rtol=1e-5, atol=1e-5)
        _keeps_the_byte_promise(f, m, layout, x)


def _keeps_the_byte_promise(f, mesh, layout, x):
    """Under objective="bytes" (the byte promise is that objective's): ``f(x)``'s values, no more
    bytes than gspmd, and md.explain's bytes per kind equal to the compiled program's."""
    lowered = md.lower(f, mesh, layout, objective="bytes")
    assert_same(lowered(x), f(x), rtol=1e-5, atol=1e-5)
    compiled = hlo_comm.analyze(lowered.lower(x).compile())
    gspmd = hlo_comm.analyze(md.lower(f, mesh, layout, backend="gspmd").lower(x).compile())
    assert compiled.total_moved_bytes() <= gspmd.total_moved_bytes(), (compiled.summary(), gspmd.summary())
    report = md.explain(f, mesh, layout, x, objective="bytes").summary()
    assert {k: v["bytes"] for k, v in report.items() if v["bytes"]} == \
        {k: v["moved_bytes"] for k, v in compiled.summary().items() if v["moved_bytes"]}


@st.composite
def pending_moves(draw):
    """A move whose source holds a pending sum: ``x`` summed over ``k``, split over an axis no
    source dim uses, then renamed to dims the layout places elsewhere (the sum resolved on the
    way: reduced in place and redistributed, or reduce-scattered, whichever moves fewer bytes)."""
    mesh, sizes, src, dst, layout = draw(moves())
    free = [a for a in mesh if not any(a in layout.get(d, ()) for d in src)]
    assume(free)
    return mesh, sizes, src, dst, {**layout, "k": (draw(st.sampled_from(free)),)}


@settings(max_examples=10, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(pending_moves())
def test_random_moves_of_pending_sums_equal_unsharded_and_explained(move):
    mesh, sizes, src, dst, rules = move
    x = md.named(jnp.asarray(np.random.default_rng(0).standard_normal(sizes + [4]), jnp.float32), " ".join(src + ["k"]))
    fn = lambda x: md.rename(md.sum(x, "k"), dict(zip(src, dst)))
    weight = md.named(jnp.asarray(np.random.default_rng(1).standard_normal(sizes), jnp.float32), " ".join(dst))
    grad = lambda x: jax.grad(lambda x: md.sum(md.sin(fn(x)) * weight).array)(x)
    m, layout = md.Mesh(mesh), md.Layout(rules)
    for f in (fn, grad):
        _keeps_the_byte_promise(f, m, layout, x)


def test_a_pending_sum_is_reduced_in_place_then_redistributed_where_that_moves_fewer_bytes():
    """A scan's step contracts the carry [b:40 f:8] (f split over data) with its weight into
    [b n] (n split over model, summing over data) and renames n to f, which the carry splits over
    data (mesh data:2 x model:4): each step all-reduces the sum in place, then moves f from model
    to data by one round of collective-permutes and a gather over half the model axis (320 + 160
    + 480 B), not gathered whole (320 + 960 B)."""
    mesh, layout = md.Mesh({"data": 2, "model": 4}), md.Layout({"f": "data", "n": "model"})
    r = np.random.default_rng(0)
    h = md.named(jnp.asarray(r.standard_normal((40, 8)), jnp.float32), "b f")
    w = md.named(jnp.asarray(r.standard_normal((3, 8, 8)), jnp.float32), "L f n")

    def fn(h, w):
        def step(h, w):
            z = md.rename(md.einsum(h, w, out="b n"), {"n": "f"})
            return md.softmax(z, "b") + h * 0.5, md.sum(z)
        return md.scan(step, h, w, dim="L")
    report = md.explain(fn, mesh, layout, h, w, objective="bytes")
    steps = {(c.kind, c.bytes) for c in report.collectives if c.count == 3}
    assert steps == {("all-reduce", 320), ("collective-permute", 160), ("all-gather", 480)}, report.collectives
    f = md.lower(fn, mesh, layout, objective="bytes")
    assert_same(f(h, w), fn(h, w), rtol=1e-5, atol=1e-5)
    compiled = hlo_comm.analyze(f.lower(h, w).compile()).summary()
    assert {k: v["bytes"] for k, v in report.summary().items() if v["bytes"]} == \
        {k: v["moved_bytes"] for k, v in compiled.items() if v["moved_bytes"]}


def test_swap_of_splits_is_two_rounds_of_half_blocks():
    p = redistribute.plan((8, 32, 16), (("data",), ("model",), ()), (("model",), ("data",), ()),
                          ("data", "model"), {"data": 2, "model": 4})
    assert p.piece == (2, 8, 16) and len(p.rounds) == 2 and p.bytes(4) == 2048
    assert sum(loc is not None for loc in p.local) == 4     # half the devices hold one piece already


def test_blocks_that_do_not_divide_each_other_have_no_plan():
    assert redistribute.plan((48,), (("x",),), (("y",),), ("x", "y"), {"x": 3, "y": 2}) is None


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.data())
def test_the_rounds_counted_without_building_the_plan_are_the_plans(data):
    """``piece_rounds`` (what a relayout weighs: no per-device tables) is the plan's piece and
    number of rounds, or None exactly where there is no plan."""
    mesh = data.draw(st.sampled_from(MESHES))
    shape = tuple(data.draw(st.lists(st.sampled_from([4, 8, 16, 32]), min_size=1, max_size=3)))
    dims = [f"d{i}" for i in range(len(shape))]
    src, tgt = _placements(data.draw, mesh, dims), _placements(data.draw, mesh, dims)
    src, tgt = tuple(src.get(d, ()) for d in dims), tuple(tgt.get(d, ()) for d in dims)
    p = redistribute.plan(shape, src, tgt, tuple(mesh), mesh)
    counted = redistribute.piece_rounds(shape, src, tgt, tuple(mesh), mesh)
    assert counted == (None if p is None else (int(np.prod(p.piece)), len(p.rounds)))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.integers(2, 6), st.integers(2, 6), st.integers(0, 2 ** 31))
def test_rounds_are_matchings_and_as_few_as_the_largest_degree(n_src, n_tgt, seed):
    """The edge colouring: every round a device sends at most once and receives at most once,
    every edge is in one round, and there are exactly max-degree rounds (Koenig)."""
    rng = np.random.default_rng(seed)
    n = max(n_src, n_tgt)
    edges = [(int(s), int(t), k, k) for k, (s, t) in enumerate(rng.integers(0, n, (rng.integers(1, 20), 2)))
             if s != t]
    rounds = redistribute._colour(edges, n)
    degree = max([sum(e[0] == d for e in edges) for d in range(n)] + [sum(e[1] == d for e in edges) for d in range(n)]
                 + [0])
    assert len(rounds) == degree
    assert sorted(itertools.chain(*rounds)) == sorted(edges)
    for r in rounds:
        assert len({e[0] for e in r}) == len(r) and len({e[1] for e in r}) == len(r)


def test_a_mask_moved_by_ppermute_rounds_stays_boolean():
    """A bernoulli mask where(bernoulli(m128), relu(reshape(v[b:x d] -> m128)), 0) with m128 over
    y (campaign 18): the mask is moved to the reshaped value's placement by ppermute rounds, and the
    piece a device keeps was promoted to int: a raw TypeError. Integers and booleans move like floats."""
    v = md.named(jnp.asarray(np.random.default_rng(0).standard_normal((16, 8)), jnp.float32), "b d")

    def fn(v):
        h = md.relu(md.reshape(v, "m128:128"))
        return h, md.where(md.random.bernoulli(jax.random.key(7), 0.7, "m128:128"), h, 0.0)

    mesh, layout = md.Mesh({"x": 4, "y": 2}), md.Layout({"b": "x", "m128": "y"})
    assert_same(md.lower(fn, mesh, layout)(v), fn(v))


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(moves(), st.sampled_from(["bool", "int32"]))
def test_random_moves_of_booleans_and_integers(move, dtype):
    """Masks and ids moved between random placements keep their values and dtype (a property
    check beside the campaign 18 case above, which it does not reach: these moves rarely keep a
    piece on its device)."""
    mesh, sizes, src, dst, rules = move
    v = np.random.default_rng(0).standard_normal(sizes)
    x = md.named(jnp.asarray(v > 0 if dtype == "bool" else np.floor(v * 9), dtype), " ".join(src))
    fn = lambda x: md.rename(x, dict(zip(src, dst)))
    assert_same(md.lower(fn, md.Mesh(mesh), md.Layout(rules))(x), fn(x))
