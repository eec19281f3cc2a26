"""md.search costs only what could rank: a layout whose arguments and outputs, or the screen's
estimate of its peak, are over the memory budget is rejected before it is traced; layouts are
costed in the order of their compute floor and the search stops where no layout left could rank;
a context-parallel layout is screened as its ring would hold, a pipeline as its stages would
with the most microbatches; each layout is planned under the budget, so a context-parallel one
takes the ring where the gathered keys would not fit;
layouts the rewriter would refuse (a pipeline's stage axis splitting another dim) are not in the
space."""

import jax
import jax.numpy as jnp

import meshdsl as md
from test_search import FLOOR, SPACE, _arg, _attend, _mlp, _mlp_grads


def test_a_layout_whose_arguments_and_outputs_alone_exceed_the_budget_is_rejected_without_tracing():
    """What every layout holds whatever it computes - its arguments and outputs, placed as the
    layout places them - is known from shapes: a layout over the budget on those alone is
    rejected without being costed, saying so; on the others it is exactly what explain counts."""
    args = _mlp(64, 256, 1024)
    mesh = md.Mesh.abstract({"data": 8})
    free = md.search(_mlp_grads, mesh, *args, top=100)
    held = {str(c.layout): c.memory["arguments"] + c.memory["outputs"] for c in free}
    assert FLOOR.Held(_mlp_grads, args).per_device(mesh, md.Layout.parse("d_ff:data")) == held["d_ff:data"]
    budget = (held["d_ff:data"] + held["batch:data"]) / 2 * 1.1   # data parallel's weights do not fit
    result = md.search(_mlp_grads, mesh, *args, memory_budget=budget, top=100, screen=False)
    early = [c for c in result.rejected if c.why.startswith("over the memory budget before costing")]
    assert {str(c.layout) for c in early} == {k for k, v in held.items() if v * 1.1 > budget} >= {"batch:data"}
    assert all(not c.memory and "arguments and outputs alone take" in c.why for c in early)
    assert result.costed == free.costed - len(early)


def test_the_screen_errs_low_and_rejects_before_tracing_only_layouts_the_costing_rejects():
    """The screen (the arguments and outputs, and the unsharded program's temporaries at their
    peak as the layout could split them) never exceeds the costed peak; under a budget the
    activations of an unsplit batch break, it rejects layouts without tracing them, saying so,
    and the ranking is the one costing every layout gives."""
    args = _mlp(65536, 128, 512)
    mesh = md.Mesh.abstract({"data": 2, "model": 4})
    held = FLOOR.Held(_mlp_grads, args)
    every = md.search(_mlp_grads, mesh, *args, top=100, screen=False)
    for c in every:
        floor = held.per_device(mesh, c.layout)
        assert floor < held.screen(mesh, c.layout, floor) <= c.memory["peak"], c.layout
    peaks = sorted(c.memory["peak"] for c in every)
    budget = peaks[len(peaks) // 2] * 1.1
    exact = md.search(_mlp_grads, mesh, *args, top=100, memory_budget=budget, screen=False)
    screened = md.search(_mlp_grads, mesh, *args, top=100, memory_budget=budget)
    early = [c for c in screened.rejected if "(screen)" in c.why]
    assert early and all("screen=False costs it" in c.why and not c.memory for c in early)
    assert screened.costed == exact.costed - len(early)
    assert [(str(c.layout), c.time) for c in screened] == [(str(c.layout), c.time) for c in exact]


def _stack_grads(x, w1, w2):
    """The gradients of a stack of ReLU MLPs run by md.scan over ``layers``, its loss (the sum of
    squares) computed by the scan's head, so that 1F1B can run it."""
    def step(h, w):
        return h + md.einsum(md.relu(md.einsum(h, w["w1"], out="batch d_ff")), w["w2"], out="batch d_model"), None

    def loss(w1, w2):
        return md.scan(step, x, {"w1": w1, "w2": w2}, dim="layers", head=lambda h: md.sum(md.square(h)))[0].array
    return jax.grad(loss, argnums=(0, 1))(w1, w2)


def test_a_pipeline_layout_is_screened_under_what_each_of_its_microbatched_schedules_holds():
    """Splitting the dim an md.scan runs over makes a pipeline: each stage holds its layers'
    share of the loop's stacked values and runs one microbatch at a time. The screen splits the
    stacked values by the stages and the batch by the microbatches (the layout's own, or the most
    the search tries), and stays under the costed peak of every microbatch count and schedule."""
    args = (_arg("batch:64 d_model:256"), _arg("layers:8 d_model:256 d_ff:1024", True),
            _arg("layers:8 d_ff:1024 d_model:256", True))
    mesh = md.Mesh.abstract({"pipe": 4, "data": 2})
    held = FLOOR.Held(_stack_grads, args)
    assert held.scanned == {"layers"}
    for rules in ("layers:pipe;batch:data", "layers:pipe", "layers:pipe;d_ff:data"):
        whole = md.Layout.parse(rules)
        floor = held.per_device(mesh, whole)
        most = held.screen(mesh, whole, floor, {"batch": 8})
        assert floor < most < held.screen(mesh, whole, floor), rules
        for m in (1, 2, 8):
            layout = md.Layout(whole.rules, params=whole.param_rules, microbatches={"batch": m})
            assert held.screen(mesh, layout, floor, {"batch": 8}) == held.screen(mesh, whole, floor, {"batch": m})
            for schedule in ("gpipe", "1f1b"):
                peak = md.explain(_stack_grads, mesh, layout, *args, schedule=schedule).memory["peak"]
                assert most <= held.screen(mesh, layout, floor) <= peak, (rules, m, schedule)


def test_a_context_parallel_layout_is_screened_under_what_its_least_holding_attention_holds():
    """Attention over 8192 positions, computed blockwise unsharded (positions held as 16 blocks
    of 512): a layout splitting the positions (renamed: ``targets`` -> ``length`` ->
    ``kv_length``, one split) is screened, and the screen stays under the peak of every attention
    strategy it could be costed with - the ring's, one chunk of queries and keys, the least - so
    the search never rejects before tracing a context-parallel layout the ring would fit."""
    x = md.named(jax.ShapeDtypeStruct((2, 8192, 2, 64), jnp.float32), "batch targets heads d_kv")
    held = FLOOR.Held(_attend, (x,))
    assert held.renamed == {"targets": {"length"}, "length": {"kv_length"}}
    mesh = md.Mesh.abstract({"data": 2, "ctx": 4})
    for rules in ("targets:ctx;batch:data", "targets:ctx", "targets:ctx;heads:data", "targets:data", "targets:data;d_kv:ctx"):
        layout = md.Layout.parse(rules)
        floor = held.per_device(mesh, layout)
        peaks = {s: md.explain(_attend, mesh, layout, x, attention=s).memory["peak"] for s in ("ring", "gather", None)}
        assert floor < held.screen(mesh, layout, floor) <= min(peaks.values()), (rules, peaks)
    layout = md.Layout.parse("targets:ctx;batch:data")
    screen = held.screen(mesh, layout, held.per_device(mesh, layout))
    tight = md.search(_attend, mesh, x, top=1000, memory_budget=screen * 0.99)
    assert any(c.layout.rules.get("length") == ("ctx",) and "(screen)" in c.why for c in tight.rejected)


def _block_grads(x, wq, wo, w1, w2):
    """One pre-norm-less transformer block's gradients: attention over the positions renamed
    (``length`` -> ``kv_length``), then a ReLU MLP."""
    def loss(wq, wo, w1, w2):
        q = md.einsum(x, wq, out="batch length heads d_head")
        kv = md.rename(q, {"length": "kv_length"})
        a = md.einsum(md.attention(q, kv, kv, over="kv_length", causal=True), wo, out="batch length d_model")
        h = md.relu(md.einsum(x + a, w1, out="batch length d_ff"))
        return md.sum(md.square(md.einsum(h, w2, out="batch length d_model"))).array
    return jax.grad(loss, argnums=(0, 1, 2, 3))(wq, wo, w1, w2)


def test_no_layout_is_predicted_faster_than_its_compute_floor_and_the_bound_keeps_the_ranking():
    """The compute floor (the unsharded program's matmuls and attention kernels, split as the
    layout splits their dims, renames included) is under every costed layout's predicted step,
    each kernel priced at its dtype's peak and all at bfloat16's (a transformer block's gradients,
    batch 8 x 4096 positions, on 8 H100s: compute-bound, so the floor is near the step for the
    layouts that split the work); searching in the floor's order and stopping where it passes the
    top's last time ranks the same layouts as costing every one, and costs fewer."""
    args = (_arg("batch:8 length:4096 d_model:1024"), _arg("d_model:1024 heads:16 d_head:64", True),
            _arg("heads:16 d_head:64 d_model:1024", True), _arg("d_model:1024 d_ff:4096", True),
            _arg("d_ff:4096 d_model:1024", True))
    held = FLOOR.Held(_block_grads, args)
    hw = md.Hardware.profile("h100-80gb")
    every = md.search(_block_grads, 8, *args, hardware=hw, top=1000, bound=False)
    assert len(every) > 10 and every.bounded == 0
    for c in every:
        for dtype in (None, "bfloat16"):
            floor = held.compute_seconds(c.mesh, c.layout, hw, dtype)
            assert floor <= c.report.time(hw, dtype=dtype).total_s, (c.describe(), dtype)
    assert held.compute_seconds(every.best.mesh, every.best.layout, hw) > 0.5 * every.best.time
    top = md.search(_block_grads, 8, *args, hardware=hw, top=3)
    assert [(c.describe(), c.time) for c in top] == [(c.describe(), c.time) for c in every][:3]
    assert top.bounded > 0 and top.costed < every.costed
    assert any(c.why.startswith("not costed: its matmuls and attention alone take") for c in top.rejected)


def test_under_a_budget_the_gathered_keys_break_a_context_parallel_layout_is_planned_with_the_ring():
    """Attention over 8192 positions split over ctx:4: by time the planner gathers the keys
    (23.8 MB a device) where that fits; under a 20 MB budget each layout is planned to fit, and
    the solve itself takes the ring (one chunk of keys) - no strategy forced by the search."""
    x = md.named(jax.ShapeDtypeStruct((2, 8192, 2, 64), jnp.float32), "batch targets heads d_kv")

    def cp(c):
        return c.layout.rules.get("length") == ("ctx",) and c.layout.rules.get("batch") == ("data",)
    mesh = md.Mesh.abstract({"data": 2, "ctx": 4})
    roomy = md.search(_attend, mesh, x, top=1000)
    assert not any("attention" in c.lower_kwargs for c in roomy.candidates + roomy.rejected)
    assert [a["strategy"] for c in roomy if cp(c) for a in c.report.attention] == ["gather"]
    tight = md.search(_attend, mesh, x, top=1000, memory_budget=20e6)
    assert [a["strategy"] for c in tight if cp(c) for a in c.report.attention] == ["ring"]
    assert not any("attention" in c.lower_kwargs for c in tight.candidates + tight.rejected)
    assert all(c.memory["peak"] * 1.1 <= 20e6 for c in tight)


def test_an_axis_splitting_the_dim_a_scan_runs_over_splits_nothing_else():
    """A pipeline's stage axis splits the scanned dim alone (the rewriter refuses a layout that
    also maps ``vocab`` to it): such groups are not in the space, so no layout is traced only to
    be refused (71 + 32 such layouts of llama-3-8b on 64 devices were)."""
    params = [(("layers", 4), ("d_model", 8), ("d_ff", 16)), (("vocab", 32), ("d_model", 8))]
    sizes = {"layers": 4, "d_model": 8, "d_ff": 16, "vocab": 32, "batch": 8}
    dim_sets = [frozenset({"layers", "d_model", "d_ff"}), frozenset({"vocab", "d_model"})]
    every = SPACE.groups(sizes, dim_sets, params)
    assert ("layers", "vocab") in every and ("d_ff", "vocab") in every
    kept = SPACE.groups(sizes, dim_sets, params, scanned={"layers"})
    assert ("layers",) in kept and ("d_ff", "vocab") in kept
    assert not any("layers" in g and len(g) > 1 for g in kept)
