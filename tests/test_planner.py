"""Unit tests of the planner and the byte model, without compiling or tracing: ``cost`` ring
formulas, ``relayout.relayout_bytes``, ``placement.plan`` and ``param_gather``'s policies,
on an abstract mesh with placements written by hand."""

import types

import jax
import jax.numpy as jnp
import pytest

import meshdsl as md
from meshdsl.rewrite import collectives, param_gather
from meshdsl.costmodel import cost
from meshdsl.platform import jaxcompat
from meshdsl.rewrite.explicit import ExplicitContext
from meshdsl.names.named import NamedArray, Placement
from meshdsl.rewrite.relayout import needs_gather, relayout_bytes

MESH = md.Mesh.abstract({"data": 2, "model": 4}, platform="cpu")
MODEL = MESH.expand(("model",))   # the rewriter places values over factor axes (meshdsl.names.mesh)


def factored(axes_per_dim):
    return tuple(MESH.expand(axes) for axes in axes_per_dim)


def ctx_for(rules=None):
    return ExplicitContext(MESH, md.Layout(rules or {}))


def placed(spec, axes=None, pending=(), dtype=jnp.float32):
    """A NamedArray of global dims ``spec`` placed by ``axes`` ({dim: axes}) with ``pending`` sums."""
    dims = md.shape(spec)
    axes = axes or {}
    pl = Placement(factored(axes.get(d.name, ()) for d in dims), frozenset(MESH.expand(tuple(pending))))
    local = tuple(d.size // MESH.axes_size(pl.of(dims, d.name)) for d in dims)
    return NamedArray(jax.ShapeDtypeStruct(local, dtype), dims, placement=pl)


@pytest.mark.parametrize("kind, operand, result, n, want", [
    ("all-reduce", 1024, 1024, 4, 1536.0),          # 2 (n-1)/n S
    ("all-gather", 256, 1024, 4, 768.0),            # (n-1)/n S_full
    ("reduce-scatter", 1024, 256, 4, 768.0),        # (n-1)/n S_full
    ("all-to-all", 1024, 1024, 4, 768.0),           # (n-1)/n S
    ("collective-permute", 1024, 1024, 4, 1024.0),  # S
    ("all-reduce", 1024, 1024, 1, 0.0),             # one device moves nothing
])
def test_ring_formulas(kind, operand, result, n, want):
    assert cost.moved_bytes(kind, operand, result, n) == want


def test_bf16_moves_as_f32_on_cpu_only():
    assert cost.element_bytes(jnp.bfloat16, "cpu") == 4
    assert cost.element_bytes(jnp.bfloat16, "gpu") == 2
    assert cost.array_bytes((8, 16), jnp.float32, "tpu") == 512


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="unknown collective kind"):
        cost.moved_bytes("broadcast", 1, 1, 2)


DIMS = md.shape("b:8 s:32 d:16")  # 4096 elements, 16 KiB in f32


@pytest.mark.parametrize("src, pending, target, want", [
    ((("data",), (), ()), (), (("data",), (), ()), 0.0),                       # nothing to do
    (((), (), ()), (), (("data",), ("model",), ()), 0.0),                     # local slices only
    ((("data",), (), ()), (), ((), (), ()), 1 / 2 * 16384),                   # gather b: (n-1)/n * S_full
    ((), ("model",), ((), (), ()), 2 * 3 / 4 * 16384),                       # pending -> whole: all-reduce
    ((), ("model",), ((), ("model",), ()), 3 / 4 * 16384),                   # pending -> split: reduce-scatter
    ((("data",), (), ()), (), ((), ("data",), ()), 1 / 2 * 8192),             # move b -> s: all-to-all
])
def test_relayout_bytes(src, pending, target, want):
    ctx = ctx_for()
    src = src or ((), (), ())
    got = relayout_bytes(ctx, DIMS, 4, factored(src), frozenset(MESH.expand(pending)), factored(target))
    assert got == pytest.approx(want)


def test_relayout_bytes_keeps_a_pending_sum_it_is_told_to_keep():
    ctx = ctx_for()
    assert relayout_bytes(ctx, DIMS, 4, ((), (), ()), frozenset(MODEL), ((), (), ()),
                          keep_pending=frozenset(MODEL)) == 0.0


def test_needs_gather():
    ctx = ctx_for()
    w = placed("d:16 f:64", {"d": ("data",), "f": ("model",)})
    assert needs_gather(ctx, w, {"f": MODEL})            # d loses data
    assert not needs_gather(ctx, w, {"d": ("data",), "f": MODEL})
    assert not needs_gather(ctx, w, {"d": ("data", *MODEL), "f": MODEL})  # only slices further


def test_plan_keeps_the_split_operands_agree_on():
    ctx = ctx_for({"b": "model"})
    x = placed("b:8 d:16", {"b": ("data",)})
    y = placed("b:8 d:16", {"b": ("data",)})
    assert ctx.plan(md.shape("b:8 d:16"), [x, y]) == {"b": ("data",), "d": ()}


def test_plan_lets_the_layout_decide_where_operands_disagree():
    ctx = ctx_for({"b": "model"})
    x = placed("b:8 d:16", {"b": ("data",)})
    y = placed("b:8 d:16")
    assert ctx.plan(md.shape("b:8 d:16"), [x, y]) == {"b": MODEL, "d": ()}


def test_plan_for_elementwise_takes_the_cheapest_placement():
    ctx = ctx_for({})  # the layout replicates b: gathering x would cost bytes, slicing y costs none
    x = placed("b:8 d:16", {"b": ("data",)})
    y = placed("b:8 d:16")
    assert ctx.plan(md.shape("b:8 d:16"), [x, y], cheapest=True) == {"b": ("data",), "d": ()}


def test_plan_puts_a_pending_sum_where_the_layout_wants_it():
    ctx = ctx_for({"d": "model"})
    x = placed("b:8 d:16", pending={"model"})   # must be reduced: reduce-scatter onto d
    assert ctx.plan(md.shape("b:8 d:16"), [x]) == {"b": (), "d": MODEL}


def test_plan_resolves_two_dims_on_one_axis_by_preference():
    ctx = ctx_for({"b": "data", "d": "data"})   # both dims disagree between operands: the layout
    x = placed("b:8 d:16", {"b": ("data",)})    # decides, and puts both on data; d is preferred
    y = placed("b:8 d:16", {"d": ("model",)})
    assert ctx.plan(md.shape("b:8 d:16"), [x, y], prefer=("d",)) == {"b": (), "d": ("data",)}
    assert ctx.plan(md.shape("b:8 d:16"), [x, y], prefer=("b",)) == {"b": ("data",), "d": ()}


def test_policies_by_name():
    assert isinstance(param_gather.make("keep"), param_gather.Keep)
    assert isinstance(param_gather.make("regather"), param_gather.Regather)
    assert isinstance(param_gather.make("auto"), param_gather.Auto)


def test_param_gather_auto_is_decided_in_the_planning_trace():
    """Whether an op gathers a stored parameter (param_gather="auto") is a decision point the
    solver takes with every other: no trace of its own. A weight [d:32, e:64] stored d:data read
    by a batch of 8 rows: moving the rows and the result (two collectives, 1280 B) moves fewer
    bytes than gathering the weight (one, 4096 B), which is faster where each collective pays
    its latency. "auto" takes the first under objective="bytes" and the second under time, each
    from the planning trace and the trace following its plan: two runs of the user's function
    at most, as "keep" (whose own choices are the plan: one)."""
    mesh, layout = md.Mesh({"data": 2, "model": 4}), md.Layout({"batch": "data"}, params={"d": "data"})
    w = md.named(jnp.ones((32, 64)), "d e", is_param=True)
    x = md.named(jnp.ones((8, 32)), "batch d")
    runs = []

    def fn(w, x):
        runs.append(1)
        return md.einsum(x, w, out="batch e")
    seen = {}
    for mode, objective in (("keep", "time"), ("auto", "time"), ("auto", "bytes")):
        runs.clear()
        report = md.explain(fn, mesh, layout, w, x, param_gather=mode, objective=objective)
        seen[mode, objective] = (len(runs), {r.kind: r.bytes for r in report.collectives})
    assert seen["keep", "time"] == (1, {"all-gather": 4096})
    assert seen["auto", "time"][1] == {"all-gather": 4096} and seen["auto", "time"][0] <= 2
    assert seen["auto", "bytes"][1] == {"all-to-all": 256, "reduce-scatter": 1024} and seen["auto", "bytes"][0] <= 2


def test_a_trace_built_apart_knows_which_values_come_from_a_differentiated_one():
    """The planner prices a candidate in a trace of its own (undifferentiated, thrown away); a rule
    there still weighs the backward pass of what it computes from a value jax.grad differentiates,
    and not of what it computes from constants."""
    seen = {}

    def loss(w, c):
        with jaxcompat.apart():
            y = jnp.tanh(w * 2.0)
            seen.update(y=jaxcompat.differentiated(y), from_c=jaxcompat.differentiated(jnp.sin(c)),
                        mixed=jaxcompat.differentiated(jnp.sin(c) + y), inner=jaxcompat.current_trace())
        assert jaxcompat.current_trace() is not seen["inner"]
        return jnp.sum(w * c)

    jax.grad(loss)(jnp.ones(3), jnp.ones(3))
    assert seen["y"] and seen["mixed"] and not seen["from_c"]


def test_a_candidate_only_priced_attaches_no_derivative():
    """In a trace built apart (a priced candidate, never differentiated) the collectives run their
    primal alone: no custom_vjp is traced. Anywhere else, under jax.grad too, the hand-written
    derivative is attached."""
    ctx = types.SimpleNamespace(rec=types.SimpleNamespace(capture=lambda: (None, 1, "forward", None)))

    def attached(x):
        f = collectives.attributed_vjp(ctx, lambda v: (v * 2.0, None), lambda _, ct: (ct * 2.0,))
        return isinstance(f, jax.custom_vjp)

    seen = {}

    def loss(w):
        seen["outside"] = jaxcompat.pricing() or attached(w)
        with jaxcompat.apart():
            seen["apart"] = (jaxcompat.pricing(), attached(w))
            with jaxcompat.apart():
                seen["nested"] = jaxcompat.pricing()
        return jnp.sum(w)

    jax.grad(loss)(jnp.ones(3))
    assert seen == {"outside": True, "apart": (True, False), "nested": True}
    assert not jaxcompat.pricing()
