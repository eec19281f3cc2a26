"""md.search: layouts ranked by the cost model (time, then bytes, then memory), invalid and
over-budget ones rejected with the reason, equivalent layouts costed once; the chosen layout
compiles to the predicted bytes within the budget; known regimes find their known answers."""

import gc
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from helpers import explain_vs_hlo, raises
from meshdsl.models.autolayout import abstract_batch, step_of
from meshdsl.models.configs import get_config
from meshdsl.models.t5 import T5

SEARCH = importlib.import_module("meshdsl.search")   # the module (md.search is the function)
SPACE = importlib.import_module("meshdsl.search.space")
FLOOR = importlib.import_module("meshdsl.search.floor")


def _arg(spec, param=False, concrete=False):
    s = md.shape(spec)
    value = (jnp.asarray(np.random.default_rng(len(spec)).standard_normal(s.sizes), jnp.float32) if concrete
             else jax.ShapeDtypeStruct(s.sizes, jnp.float32))
    x = md.named(value, s.names)
    return md.param(x) if param else x


def _mlp_grads(x, w1, w2):
    def loss(w1, w2):
        h = md.relu(md.einsum(x, w1, out="batch d_ff"))
        return md.sum(md.square(md.einsum(h, w2, out="batch d_model"))).array
    return jax.grad(loss, argnums=(0, 1))(w1, w2)


def _mlp(batch, d_model, d_ff, concrete=False):
    return (_arg(f"batch:{batch} d_model:{d_model}", concrete=concrete),
            _arg(f"d_model:{d_model} d_ff:{d_ff}", True, concrete), _arg(f"d_ff:{d_ff} d_model:{d_model}", True, concrete))


def _attend(x):
    """Causal self-attention of ``x`` [batch targets heads d_kv], its positions renamed to
    ``length`` (the queries) and ``kv_length`` (the keys)."""
    q = md.rename(x, {"targets": "length"})
    kv = md.rename(q, {"length": "kv_length"})
    return md.attention(q, kv, kv, causal=True)


def test_the_best_is_the_models_argmin_over_every_layout_of_a_small_space():
    """Every layout of batch, d_model, d_ff on data:2 x model:4 costed by md.explain and the time
    model independently: the search's order is theirs."""
    args = _mlp(16, 64, 256)
    mesh = md.Mesh.abstract({"data": 2, "model": 4})
    hw = md.Hardware.profile("h100-80gb")
    result = md.search(_mlp_grads, mesh, *args, hardware=hw, top=100)
    by_hand = {}
    for data in (None, "batch", "d_model", "d_ff"):
        for model in (None, "batch", "d_model", "d_ff"):
            rules = {}
            for axis, dim in (("data", data), ("model", model)):
                if dim:
                    rules[dim] = rules.get(dim, ()) + (axis,)
            r = md.explain(_mlp_grads, mesh, md.Layout(rules), *args)
            by_hand[str(md.Layout(rules))] = (r.time(hw).total_s, r.total_bytes, r.memory["peak"])
    assert len(result) + len(result.rejected) == len(by_hand) == 16
    assert [str(c.layout) for c in result] == sorted(by_hand, key=by_hand.get)[:len(result)]
    assert result.best.key == min(by_hand.values())
    assert result.best.why.startswith("fastest predicted")


def test_a_layout_that_splits_a_dim_the_axes_do_not_divide_is_pruned_before_costing():
    result = md.search(_mlp_grads, md.Mesh.abstract({"data": 8}), *_mlp(4, 64, 256))
    assert [c.why for c in result.rejected] == ["pruned: batch:4 does not divide by data (8)"]
    assert result.costed == 3   # nothing, d_model:data, d_ff:data


@pytest.mark.parametrize("collecting", [True, False])
def test_a_search_leaves_the_garbage_collector_as_it_found_it(collecting):
    """The search pauses Python's garbage collector while it costs layouts (collecting after each
    traced layout), and restores it after, also when a layout fails to trace."""
    def broken(x, w1, w2):
        raise TypeError("a user's bug")
    was = gc.isenabled()
    try:
        gc.enable() if collecting else gc.disable()
        md.search(_mlp_grads, md.Mesh.abstract({"data": 8}), *_mlp(8, 64, 256))
        assert gc.isenabled() == collecting
        with pytest.raises(TypeError):
            md.search(broken, md.Mesh.abstract({"data": 8}), *_mlp(8, 64, 256))
        assert gc.isenabled() == collecting
    finally:
        gc.enable() if was else gc.disable()


def test_equivalent_layouts_of_a_device_count_are_costed_once():
    """On 8 devices, d_ff:data of data:8 and d_ff:data+model of data:2 x model:4 put the same
    blocks on the same devices: only the first is costed and listed."""
    result = md.search(_mlp_grads, 64, *_mlp(64, 64, 256), top=100)
    groups = [(str(c.mesh), str(c.layout)) for c in result]
    assert ("data:64", "d_ff:data") in groups
    assert not [g for g in groups if g[1] in ("d_ff:data+model", "batch:data+model", "d_model:data+model")]
    assert {str(c.mesh) for c in result} == {"data:64", "data:2 x model:32", "data:4 x model:16",
                                             "data:8 x model:8", "data:16 x model:4", "data:32 x model:2"}


def test_a_layout_of_the_shape_of_one_costed_is_retimed_not_traced_and_costs_what_explain_says():
    """``batch:data;d_ff:model`` on ``data:16 x model:4`` and ``batch:model;d_ff:data`` on
    ``data:4 x model:16`` are one per-device program under two names for the axes: the second is
    not traced again, and its costs (collectives with their axes, FLOPs, memory, time on its own
    links) are what explaining it afresh gives."""
    args = _mlp(256, 64, 512)
    hw = md.Hardware.profile("h100-80gb")
    result = md.search(_mlp_grads, 64, *args, top=1000, zero=True)
    assert result.retimed > 0 and f"(+{result.retimed} retimed)" in result.to_markdown()
    everything = list(result) + [c for c in result.rejected if c.report is not None]
    assert len({id(c.report) for c in everything}) == len(everything)
    checked = 0
    for cand in everything:
        fresh = md.explain(_mlp_grads, cand.mesh, cand.layout, *args, **cand.lower_kwargs)
        assert [(r.kind, r.axes, r.total_bytes, r.count) for r in cand.report.collectives] == \
               [(r.kind, r.axes, r.total_bytes, r.count) for r in fresh.collectives], cand.describe()
        assert (cand.report.flops, cand.report.memory, cand.report.bytes_accessed) == \
               (fresh.flops, fresh.memory, fresh.bytes_accessed)
        assert cand.time == pytest.approx(fresh.time(hw).total_s, rel=1e-12)
        checked += 1
    assert checked == result.costed + result.retimed - len([c for c in result.rejected if c.why.startswith("invalid")])


def test_the_chosen_layout_compiles_to_the_predicted_bytes_within_the_memory_budget():
    args = _mlp(64, 32, 128, concrete=True)
    budget = 44 * 2 ** 10   # the estimate is within 10% here (of 40 KiB); the search keeps a 10% margin
    result = md.search(_mlp_grads, 8, *args, memory_budget=budget)
    best = result.best
    assert any(c.why.startswith("over the memory budget") for c in result.rejected)
    assert best.memory["peak"] * 1.1 <= budget and not best.mesh.is_abstract   # the default margin: 10%
    assert best.lower_kwargs["memory_budget"] == pytest.approx(budget / 1.1)   # planned to fit, less the margin
    over = [c for c in result.rejected if c.why.startswith("over the memory budget:")]
    assert all(c.memory["peak"] * 1.1 > budget if c.memory else "no plan of this program holds at most" in c.why
               for c in over)
    explained, compiled = explain_vs_hlo(_mlp_grads, best.mesh, best.layout, *args, **best.lower_kwargs)
    assert explained == compiled == {k: v["bytes"] for k, v in best.bytes.items() if v["bytes"]}
    memory = md.lower(_mlp_grads, best.mesh, best.layout, **best.lower_kwargs).lower(*args).compile().memory_analysis()
    assert memory.argument_size_in_bytes + memory.output_size_in_bytes + memory.temp_size_in_bytes <= budget


def test_a_tiny_batch_with_a_huge_ffn_is_tensor_parallel():
    """batch 8, d_ff 256k: the weights dominate (memory traffic and their gradient's all-reduce
    under data parallelism); splitting d_ff over every device is fastest."""
    best = md.search(_mlp_grads, 8, *_mlp(8, 1024, 262144)).best
    assert best.layout.rules.get("d_ff") and "batch" not in best.layout.rules, best


def test_a_large_batch_with_small_weights_is_data_parallel():
    """batch 64k, d_model = d_ff = 1024: the matmuls dominate and the gradient sum is small."""
    best = md.search(_mlp_grads, 8, *_mlp(65536, 1024, 1024)).best
    assert best.layout.rules == {"batch": ("data",)}, best


def test_a_tight_memory_budget_stores_the_parameters_split():
    """Data parallel holds every weight on each device; under a budget below that, the search
    keeps data parallelism and stores the weights split (ZeRO-3)."""
    args = _mlp(65536, 1024, 1024)
    dp = md.search(_mlp_grads, md.Mesh.abstract({"data": 8}), *args, zero=True).best
    assert dp.layout.rules == {"batch": ("data",)} and not dp.layout.param_rules
    budget = dp.memory["peak"] * 1.1 - 1   # data parallel's peak with the search's 10% margin is over it
    zero = md.search(_mlp_grads, md.Mesh.abstract({"data": 8}), *args, zero=True, memory_budget=budget).best
    assert zero.layout.param_rules and zero.memory["peak"] < dp.memory["peak"], zero
    assert any("over the memory budget" in c.why for c in md.search(
        _mlp_grads, md.Mesh.abstract({"data": 8}), *args, zero=True, memory_budget=budget).rejected)


def test_the_table_lists_rank_layout_time_bytes_memory_and_why():
    result = md.search(_mlp_grads, md.Mesh.abstract({"data": 2, "model": 4}), *_mlp(16, 64, 256), top=3)
    text = result.to_markdown()
    assert "| rank | mesh | layout | step (predicted) | bytes/device | peak memory/device | why |" in text
    assert text.count("\n| ") == 2 + 3 and "times on h100-80gb" in text
    assert "<table>" in result._repr_html_()


def test_a_budget_written_as_text_is_read_and_an_unreadable_one_is_refused():
    args = _mlp(16, 64, 256)
    mesh = md.Mesh.abstract({"data": 8})
    assert md.search(_mlp_grads, mesh, *args, memory_budget="1GiB").best
    with raises(md.MeshDSLError, "memory_budget: cannot read '1 GX' as a size in bytes; write it as 12GiB"):
        md.search(_mlp_grads, mesh, *args, memory_budget="1 GX")


def test_dims_the_program_does_not_have_are_refused():
    with raises(md.MeshDSLError, r"dims=\['dff'\] are not dims of the program \(it has \['batch', "
                                 r"'d_ff', 'd_model'\]\)"):
        md.search(_mlp_grads, 8, *_mlp(16, 64, 256), dims=["batch", "dff"])


def test_a_dim_the_program_renames_an_argument_dim_to_is_searched():
    """The batch names its positions ``targets``; the model attends over ``length`` (a rename):
    context parallelism (a layout splitting ``length``) is in the default space, the positions
    split as one under all their names (``targets``, ``length``, ``kv_length``: a name split
    alone would leave the others' values whole), and ``length`` may be named alone in ``dims=``."""
    x = md.named(jax.ShapeDtypeStruct((2, 2048, 2, 64), jnp.float32), "batch targets heads d_kv")

    mesh = md.Mesh.abstract({"data": 2, "ctx": 4})
    every = md.search(_attend, mesh, x, top=1000)
    placed = {d for c in every.candidates + every.rejected for d in c.layout.rules}
    assert {"length", "kv_length"} <= placed
    assert any(c.layout.rules.get("length") == ("ctx",) for c in every.candidates)
    positions = ("kv_length", "length", "targets")
    for c in every.candidates + every.rejected:
        assert len({c.layout.rules.get(d, ()) for d in positions}) == 1, c.describe()
    named = md.search(_attend, mesh, x, dims=["batch", "length"], top=1000)
    assert {d for c in named.candidates for d in c.layout.rules} <= {"batch", "length"}


def test_arguments_without_named_arrays_are_refused():
    with raises(md.MeshDSLError, "the arguments hold no NamedArray"):
        md.search(lambda x: x, 8, np.ones(3))


def test_a_device_count_that_is_not_a_positive_int_is_refused():
    with raises(md.MeshDSLError, "is neither an md.Mesh nor a device count"):
        md.search(_mlp_grads, 0, *_mlp(16, 64, 256))


def test_no_layout_within_the_budget_says_where_to_look():
    result = md.search(_mlp_grads, md.Mesh.abstract({"data": 8}), *_mlp(16, 64, 256), memory_budget=1)
    assert not len(result) and all("over the memory budget" in c.why for c in result.rejected)
    with raises(md.MeshDSLError, "md.search found no valid layout within the budget; see .rejected"):
        result.best


@pytest.mark.parametrize("count", [1, 7])
def test_a_device_count_with_no_two_axis_factorisation_searches_one_axis(count):
    result = md.search(_mlp_grads, count, *_mlp(14, 64, 256), top=100)
    assert {str(c.mesh) for c in result} == {f"data:{count}"}


def test_a_device_count_is_factorised_into_up_to_three_axes_when_asked():
    """``mesh_axes=3`` adds ``data x model x pipe`` factorisations: a stacked pipeline over one
    axis with data and tensor parallelism over the others is in the space."""
    stack = importlib.import_module("test_pipeline")
    args = (_arg("batch:32 d_model:64"), _arg("layers:4 d_model:64 d_ff:256", True), _arg("layers:4 d_ff:256 d_model:64", True))
    dims = ["batch", "d_ff", "layers"]
    result = md.search(stack.loss_and_grads, 8, *args, mesh_axes=3, microbatches=(4,), top=1000, dims=dims)
    three = [c for c in list(result) + result.rejected if str(c.mesh) == "data:2 x model:2 x pipe:2"]
    assert three and {str(c.mesh) for c in result} >= {"data:8", "data:2 x model:4"}
    assert any(set(c.layout.rules) == {"batch", "d_ff", "layers"} and c.layout.microbatches for c in three)
    assert "data:2 x model:2 x pipe:2" not in {str(c.mesh) for c in md.search(stack.loss_and_grads, 8, *args, top=1000,
                                                                               dims=dims)}
    with raises(md.MeshDSLError, "md.search: mesh_axes=4; a device count is factorised into 1 to 3 axes"):
        md.search(stack.loss_and_grads, 8, *args, mesh_axes=4)


def _t5_step(config_name, batch, inputs=512, targets=128, remat="none"):
    """A T5 training step (loss and gradients), abstract: the model and a batch of shapes."""
    model = nnx.eval_shape(lambda: T5(get_config(config_name).replace(dropout_rate=0.0), rngs=nnx.Rngs(0)))
    return step_of(remat), model, abstract_batch(batch, inputs, targets)


def test_t5_xxl_on_256_h100s_fits_where_data_parallel_does_not_and_says_why():
    """t5-v1_1-xxl (11B parameters, float32, remat full) on 256 H100-80GB as data:32 x model:8,
    batch 256 x 512 / 128: data parallelism holds every weight and its gradient (88 GB) on each
    device and is rejected over the budget before costing, saying so; a layout splitting the weights over
    model fits."""
    step, model, batch = _t5_step("t5-v1_1-xxl", 256, remat="full")
    mesh = md.Mesh.abstract({"data": 32, "model": 8})
    result = md.search(step, mesh, model, batch, hardware="h100-80gb", dims=["batch", "heads", "d_ff"], top=100)
    dp = [c for c in result.rejected if c.layout.rules == {"batch": ("data",)}]
    assert dp and dp[0].why.startswith("over the memory budget before costing: its arguments and outputs alone")
    assert FLOOR.Held(step, (model, batch)).per_device(mesh, dp[0].layout) > 80e9   # weights and gradients
    best = result.best
    assert best.memory["peak"] * 1.1 <= md.Hardware.profile("h100-80gb").memory_bytes
    assert {"heads", "d_ff"} & set(best.layout.rules) and "batch" in best.layout.rules, best


def test_zero3_storage_puts_one_dim_per_axis_in_every_parameter():
    """The ZeRO-3 storage rules the search tries are valid for every parameter: T5's attention
    weights [layers d_model heads d_kv] hold d_model and heads, so the two must not be stored over
    one axis (they were: every ZeRO-3 candidate of a T5 step was invalid)."""
    _, model, batch = _t5_step("t5-v1_1-xxl", 256)
    mesh = md.Mesh.abstract({"data": 32, "model": 8})
    params = [leaf for leaf in jax.tree_util.tree_leaves(nnx.state(model), is_leaf=lambda x: isinstance(x, md.NamedArray))
              if isinstance(leaf, md.NamedArray)]
    for rules in ({"batch": ("data",), "heads": ("model",)}, {"batch": ("data",), "d_ff": ("model",)},
                  {"batch": ("data", "model")}):
        stored = SPACE.zero_rules(mesh, rules, [tuple((d.name, d.size) for d in p.dims) for p in params])
        assert stored, rules
        layout = md.Layout(rules, params=stored)
        for p in params:   # raises LayoutError where a parameter would hold one axis twice
            layout.tensor_axes(p.dims, mesh, storage=True, what=f"{rules} {stored}: [{p.dims}]")


def test_a_tight_memory_budget_chooses_remat_among_the_programs_choices():
    """``choices={"remat": [...]}`` costs every layout with each; with room for the activations
    no remat is fastest, and under a budget below that layout's peak the search keeps it and
    recomputes (remat full) rather than moving to a slower layout."""
    train_step, model, batch = _t5_step("t5-small", 64, inputs=256, targets=64)   # takes remat= too
    mesh = md.Mesh.abstract({"data": 8})
    free = md.search(train_step, mesh, model, batch, dims=["batch"], choices={"remat": ["none", "full"]}, top=100)
    assert {(str(c.layout), c.choices["remat"]) for c in free} == {("batch:data", "none"), ("batch:data", "full"),
                                                                    ("", "none"), ("", "full")}
    fastest = free.best
    assert fastest.choices == {"remat": "none"} and "remat=none" in free.to_markdown()
    full = next(c for c in free if c.choices == {"remat": "full"} and c.layout == fastest.layout)
    assert full.memory["peak"] < fastest.memory["peak"] and full.time > fastest.time   # recomputing costs time
    budget = (full.memory["peak"] + fastest.memory["peak"]) / 2 * 1.1
    tight = md.search(train_step, mesh, model, batch, dims=["batch"], choices={"remat": ["none", "full"]},
                      memory_budget=budget)
    assert (tight.best.layout, tight.best.choices) == (fastest.layout, {"remat": "full"})
    assert tight.best.key == full.key
    with raises(md.MeshDSLError, re.escape("md.search: choices ['remat'] must each be a non-empty list of values to try")):
        md.search(train_step, mesh, model, batch, dims=["batch"], choices={"remat": "full"})


def test_a_pipelined_program_is_searched_with_its_microbatch_counts_and_schedules():
    """A layout splitting the layers a ``md.scan`` runs over makes the program a pipeline: the
    search also costs it with each microbatch count (those dividing the batch) and schedule,
    each explained as its own pipeline (more microbatches, a smaller bubble)."""
    stack = importlib.import_module("test_pipeline")
    args = (_arg("batch:64 d_model:256"), _arg("layers:8 d_model:256 d_ff:1024", True),
            _arg("layers:8 d_ff:1024 d_model:256", True))
    mesh = md.Mesh.abstract({"pipe": 4, "data": 2})
    result = md.search(stack.loss_and_grads, mesh, *args, dims=["layers", "batch"], microbatches=(2, 4, 128),
                       schedules=("gpipe", "1f1b"), top=1000)
    piped = {(str(c.layout), c.lower_kwargs.get("schedule")): c for c in result}
    bubbles = [piped[(f"layers:pipe;batch:data | microbatches batch:{m}", "gpipe")].report.pipeline["bubble_fraction"]
               for m in (2, 4)]
    assert bubbles[1] < bubbles[0]
    assert piped[("layers:pipe;batch:data", None)].report.pipeline["microbatches"] == 1
    assert not [k for k in piped if "batch:128" in k[0]]   # 128 does not divide a batch of 64
    rejected = [c for c in result.rejected if c.lower_kwargs.get("schedule") == "1f1b"]
    assert rejected and all("schedule '1f1b' runs each microbatch's backward pass inside" in c.why for c in rejected)
    assert "schedule=1f1b" in rejected[0].describe()


def _auto_mtf_program(repeats=1):
    def program(x1, x2):
        zs = [md.einsum(x1, x2, out="a c") for _ in range(repeats)]
        return zs[0] if repeats == 1 else zs
    return program


@pytest.mark.parametrize("repeats", [1, 100])
def test_mesh_tensorflows_auto_mtf_cases_find_its_answers(repeats):
    """Mesh TensorFlow's layout optimizer tests (auto_mtf api_test / layout_optimizer_test):
    x1 [a:10 b:5], x2 [b:5 c:20], z = einsum -> [a c]. On mesh m1:4 x m2:2 the answer is
    a:m2;c:m1 (b:5 divides by neither axis; every device then computes its block of z alone), also
    with the einsum repeated 100 times; given 8 devices, a mesh of a 4-axis and a 2-axis with a on
    the 2 and c on the 4; on one axis of 8 nothing can be split."""
    args = (_arg("a:10 b:5"), _arg("b:5 c:20"))
    program = _auto_mtf_program(repeats)
    best = md.search(program, md.Mesh.abstract({"m1": 4, "m2": 2}), *args).best
    assert best.layout.rules == {"a": ("m2",), "c": ("m1",)} and best.total_bytes == 0
    if repeats > 1:
        return
    best = md.search(program, 8, *args).best
    sizes = {d: best.mesh.shape[axes[0]] for d, axes in best.layout.rules.items()}
    assert sizes == {"a": 2, "c": 4} and sorted(best.mesh.shape.values()) == [2, 4]
    one_axis = md.search(program, 8, *args, mesh_axes=1, top=100)
    assert [str(c.layout) for c in one_axis] == [""]


def test_one_axis_may_split_several_dims_that_no_value_holds_together():
    """Megatron puts heads and d_ff (T5: and vocab) on one axis - no tensor holds two of them.
    The search tries such groups (read from one shape-only trace of the program) and never
    dims a value holds together (batch and heads share the attention logits)."""
    step, model, batch = _t5_step("t5-small", 16, inputs=128, targets=32)
    mesh = md.Mesh.abstract({"data": 2, "model": 4})
    result = md.search(step, mesh, model, batch, dims=["batch", "heads", "d_ff"], top=1000)
    rules = [c.layout.rules for c in list(result) + result.rejected]
    assert {"batch": ("data",), "heads": ("model",), "d_ff": ("model",)} in rules
    megatron = next(c for c in result if c.layout.rules == {"batch": ("data",), "heads": ("model",), "d_ff": ("model",)})
    fresh = md.explain(step, mesh, megatron.layout, model, batch)
    assert megatron.total_bytes == fresh.total_bytes and megatron.memory == fresh.memory
    for r in rules:
        for axis in mesh.shape:
            assert len({d for d, axes in r.items() if axis in axes} & {"batch", "heads"}) < 2, r
