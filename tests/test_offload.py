"""Offload: what lives in host memory, and what crosses the host link.

* a stack in host memory (``offload="params"``): each layer fetched while the layer before
  computes, explain's memory within 10% of the compiled; layouts that say what they offload;
  searches that offload only where nothing else fits (the CLI's training runs:
  ``test_offloaded_training_trains_as_on_the_device.py``);
* activations: the remat policies ``"offload"`` and ``"offload-dots"`` keep a scan's residuals in
  host memory, ``md.explain`` counts them there and on the host link, and under ``remat="auto"``
  the plan offloads where the host link beats recomputing."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from jax.extend import core as jcore
from meshdsl.costmodel import jaxpr_stats
from meshdsl.platform import jaxcompat
from meshdsl.models.families.configs import get_config
from meshdsl.models.training.optim import make_optimizer
from meshdsl.ops import remat as remats
import helpers
from helpers import gated_mlp_grads, gated_mlp_stack
from meshdsl.models.training import trainer as trainer_module

def test_a_stack_in_host_memory_is_fetched_layer_by_layer_and_priced_so():
    """``offload="params"``: md.place keeps the parameters in host memory; a scan brings each
    layer's slice to the device one layer ahead in the forward pass and again in the backward pass
    (never the whole stack, never kept there; each pass's last step fetches one slice no step
    uses), sends each layer's gradient back, and explain counts it, each transfer by pass,
    direction and the line of the scan: the device holds neither the parameters nor their
    gradients, the host link carries them."""
    args, mesh = gated_mlp_stack(layers=8, batch=8, seq=16, d_model=64, d_ff=256), md.Mesh({"data": 8})
    on_device, offloaded = md.Layout({"batch": "data"}), md.Layout({"batch": "data"}, offload="params")
    placed = md.place(args, mesh, offloaded)
    assert [a.raw.sharding.memory_kind for a in placed] == ["pinned_host", "pinned_host", "device"]
    got = md.lower(gated_mlp_grads("none"), mesh, offloaded)(*placed)
    for g, w in zip(got, gated_mlp_grads("none")(*args)):
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(w.array), rtol=1e-4, atol=1e-5)
        assert g.raw.sharding.memory_kind == "pinned_host"
    params = sum(a.raw.nbytes for a in args[:2])
    report = md.explain(gated_mlp_grads("none"), mesh, offloaded, *placed)
    layers = args[0].raw.shape[0]
    assert report.memory["transfers"] == {"to device": 2 * params * (layers + 1) // layers, "to host": params}
    assert report.memory["host"] == 2 * params   # the parameters, and their gradients sent back
    scan = next(f"helpers.py:{k + 1}" for k, text in enumerate(open(helpers.__file__).read().splitlines())
                if "h, _ = md.scan(step, x, (w1, w2)" in text)   # where the program streams them
    slices, one = 2 * (layers + 1), params / layers / 2   # both stacks per pass, and one fetched ahead of none
    rows = sorted((r["phase"], r["direction"], r["line"], r["count"], r["bytes"])
                  for r in report.memory["host_transfers"])
    assert rows == [("backward", "to device", scan, slices, one), ("backward", "to host", scan, 2 * layers, one),
                    ("forward", "to device", scan, slices, one)]
    assert f"| backward | {scan} | to host | {2 * layers} |" in report.to_markdown()
    kept = md.explain(gated_mlp_grads("none"), mesh, on_device, *args).memory["peak"]
    assert report.memory["peak"] <= kept - 2 * params     # neither the parameters nor their gradients


def _fetches(jaxpr):
    """Per scan body reading a slice from host memory (outermost first): the values it brings to
    the device, and whether any op of that body reads them."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            body = jaxcompat.scan_parts(eqn).body
            moved = [e.outvars[0] for e in body.eqns if e.primitive.name == "device_put"
                     and jaxcompat.in_host_memory(e.invars[0].aval) and not jaxcompat.in_host_memory(e.outvars[0].aval)]
            if moved:
                read = {v for e in body.eqns for v in e.invars if isinstance(v, jcore.Var)}
                found.append((moved, [v in read for v in moved], [v in body.outvars for v in moved]))
        for sub in jaxpr_stats.sub_jaxprs(eqn):
            found.extend(_fetches(sub))
    return found


def _layered_grads(reverse):
    """Gradients (of ``w1``, ``w2``, ``x``) of a gated MLP stack scanned over ``layers`` (backwards
    where ``reverse``), each layer scaled by its layer number (an integer stack on the device) and
    returning a per-layer value (``ys``)."""
    def loss(w1, w2, x, k):
        def step(h, ws):
            a, b, i = ws
            u = md.einsum(h, a, out="batch seq d_ff")
            h = h + md.einsum(md.tanh(u) * md.sigmoid(u), b, out="batch seq d_model") * (1.0 + 0.1 * i.astype(jnp.float32))
            return h, md.sum(h)
        h, ys = md.scan(step, x, (w1, w2, k), dim="layers", reverse=reverse)
        return (md.sum(h * h) + md.sum(ys * ys)).array / x.size
    return lambda w1, w2, x, k: jax.grad(loss, argnums=(0, 1, 2))(w1, w2, x, k)


@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
def test_each_layer_is_fetched_while_the_layer_before_computes(reverse):
    """A scan over a stack in host memory brings step ``j + 1``'s slice to the device during step
    ``j`` (the transfer is carried to the next step; no op of the step waiting on it), in the
    forward loop and in the backward loop, which runs the layers the other way round; values and
    gradients are those of the program on one device, with ``ys``, an integer stack on the device
    and a scan run backwards."""
    w1, w2, x = gated_mlp_stack(layers=4, batch=8, seq=8, d_model=32, d_ff=64)
    args = (w1, w2, x, md.named(jnp.arange(4), "layers"))
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data"}, offload="params")
    placed = md.place(args, mesh, layout)
    lowered = md.lower(_layered_grads(reverse), mesh, layout)
    for g, w in zip(lowered(*placed), _layered_grads(reverse)(*args)):
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(w.array), rtol=1e-4, atol=1e-5)
    closed, _, _ = lowered.trace(*placed)
    loops = _fetches(jaxpr_stats.inner_body(closed))
    assert len(loops) == 2   # the forward loop and the backward loop
    for moved, read, carried in loops:
        assert len(moved) == 2 and not any(read) and all(carried)


_PASSING_ON = {"device_put", "dynamic_slice", "slice", "squeeze", "reshape", "scan", "while", "jit", "pjit",
               "custom_vjp_call", "closed_call", "remat", "checkpoint"}


def _host_readers(jaxpr) -> set:
    """The primitives reading a value in host memory, in ``jaxpr`` and the programs it calls."""
    found = set()
    for eqn in jaxpr.eqns:
        if any(isinstance(v, jcore.Var) and jaxcompat.in_host_memory(v.aval) for v in eqn.invars):
            found.add(eqn.primitive.name)
        for sub in jaxpr_stats.sub_jaxprs(eqn):
            found |= _host_readers(sub)
    return found


def test_nothing_computes_on_a_value_in_host_memory():
    """Parameters in host memory, read inside a scan and outside it (a weight multiplying the
    input first), are only ever moved to the device, sliced on the way or passed on to a loop or
    call: no arithmetic runs on a host array (XLA would run it on the host, slowly, unasked).
    Values and gradients are the single device's."""
    w1, w2, x = gated_mlp_stack(layers=4, batch=8, seq=8, d_model=32, d_ff=64)
    w0 = md.param(md.named(jnp.eye(32) + 0.01, "d_model d_out"))

    def grads(w0, w1, w2, x):
        def loss(w0, w1, w2, x):
            h = md.rename(md.einsum(x, w0, out="batch seq d_out"), {"d_out": "d_model"})
            def step(h, ws):
                u = md.einsum(h, ws[0], out="batch seq d_ff")
                return h + md.einsum(md.tanh(u), ws[1], out="batch seq d_model"), None
            h, _ = md.scan(step, h, (w1, w2), dim="layers")
            return md.sum(h * h).array
        return jax.grad(loss, argnums=(0, 1, 2))(w0, w1, w2, x)

    args, mesh = (w0, w1, w2, x), md.Mesh({"data": 8})
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"}, offload="params")
    placed = md.place(args, mesh, layout)
    assert [a.raw.sharding.memory_kind for a in placed[:3]] == ["pinned_host"] * 3
    lowered = md.lower(grads, mesh, layout)
    for g, w in zip(lowered(*placed), grads(*args)):
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(w.array), rtol=1e-4, atol=1e-5)
    closed, _, _ = lowered.trace(*placed)
    readers = _host_readers(jaxpr_stats.inner_body(closed))
    assert "device_put" in readers and readers <= _PASSING_ON, readers - _PASSING_ON
    # explain names the user's line of each transfer: the einsum's for w0, the scan's for the stacks
    rows = md.explain(grads, mesh, layout, *placed).memory["host_transfers"]
    lines = {r["line"] for r in rows}
    assert len(lines) == 2 and all(line.startswith("test_offload.py:") for line in lines), rows


def test_the_backward_pass_makes_again_what_it_computes_from_a_fetched_slice():
    """Under ZeRO-3 storage in host memory each layer's slice is gathered after it is fetched; the
    backward pass gathers it again from the slice it fetches rather than keeping every layer's
    gathered weights: the compiled program's temporaries are under the gathered stack (and the
    values are the single device's)."""
    args, mesh = gated_mlp_stack(layers=8, batch=8, seq=16, d_model=64, d_ff=256), md.Mesh({"data": 8})
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"}, offload="params")
    placed = md.place(args, mesh, layout)
    for g, w in zip(md.lower(gated_mlp_grads("full"), mesh, layout)(*placed), gated_mlp_grads("full")(*args)):
        np.testing.assert_allclose(np.asarray(g.array), np.asarray(w.array), rtol=1e-4, atol=1e-5)
    gathered = sum(a.raw.nbytes for a in args[:2])   # every layer's weights, whole on each device
    compiled = md.explain(gated_mlp_grads("full"), mesh, layout, *args).compiled_memory()
    assert compiled["temporaries"] < gathered / 2


def _explained_and_allocated(stored, remat, offload):
    args, mesh = gated_mlp_stack(layers=8, batch=8, seq=16, d_model=64, d_ff=256), md.Mesh({"data": 8})
    layout = md.Layout({"batch": "data"}, params=stored, offload=offload)
    report = md.explain(gated_mlp_grads(remat), mesh, layout, *args)   # (the arrays on the device)
    compiled = report.compiled_memory()
    allocated = compiled["arguments"] + compiled["outputs"] + compiled["temporaries"]
    return report, report.memory["peak"] + report.memory.get("host", 0), allocated, args


@pytest.mark.parametrize("stored, remat", [(None, "none"), (None, "full"), ({"d_model": "data"}, "none"),
                                           ({"d_model": "data"}, "full")],
                         ids=["replicated-none", "replicated-full", "zero3-none", "zero3-full"])
def test_explain_memory_of_a_streamed_stack_is_within_10_percent_of_the_compiled(stored, remat):
    """With the parameters in host memory, explain's device peak plus its host memory (the
    parameters there, and their gradients sent back) is within 10% of what the compiled program
    allocates, host buffers included (XLA:CPU counts them with the device's). The compiled
    program is lowered as the parameters will enter, in host memory, whatever memory the
    arrays given to explain sit in. ZeRO-3 under remat "full" holds less than jax's order of the
    backward pass would: XLA runs the input's gradient first and frees the gathered weights
    before the weight-gradient matmuls (explain's list schedule of the loop body)."""
    report, predicted, allocated, args = _explained_and_allocated(stored, remat, "params")
    assert report.memory["arguments"] == args[2].raw.nbytes // 8   # only x's block: the parameters are not on the device
    assert abs(predicted / allocated - 1) <= 0.10


def test_a_layout_writes_what_it_offloads_and_refuses_what_it_cannot():
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"}, offload="optimizer")
    assert str(layout) == "batch:data | params d_model:data | offload optimizer"
    assert layout != md.Layout({"batch": "data"}, params={"d_model": "data"})
    assert layout == md.Layout({"batch": "data"}, params="d_model:data", offload=["optimizer"])
    with pytest.raises(md.LayoutError, match=r"offload names 'activations'; what a layout can keep in host memory "
                                             r"is \['optimizer', 'params'\] \(activations: a remat policy"):
        md.Layout({"batch": "data"}, offload="activations")


def test_offload_on_devices_without_host_memory_is_refused_before_compiling(monkeypatch):
    monkeypatch.setattr(trainer_module, "host_memory_kind", lambda device=None: None)
    tx, schedule = make_optimizer("adafactor", 1e-2, 0, 10, "constant")
    layout = md.Layout({"batch": "data"}, offload="optimizer")
    with pytest.raises(md.LayoutError, match=r"offloads optimizer to host memory, but the cpu devices here have "
                                             r"no 'pinned_host' memory; remove the offload"):
        trainer_module.Trainer(get_config("t5-tiny"), md.Mesh({"data": 8}), layout, tx, schedule)


# -- activation offload: remat policies that keep the residuals in host memory --------------------

def _stack(abstract: bool = False):
    args = gated_mlp_stack()
    if not abstract:
        return args
    return [md.named(jax.ShapeDtypeStruct(a.raw.shape, jnp.bfloat16), a.dims, is_param=a.is_param) for a in args]


@pytest.mark.parametrize("policy, base", [("offload", "none"), ("offload-dots", "dots")])
def test_an_offloading_policy_computes_the_same_and_holds_its_residuals_on_the_host(policy, base):
    args, mesh, layout = _stack(), md.Mesh({"data": 8}), md.Layout({"batch": "data"})
    want = gated_mlp_grads("none")(*args)
    got = md.lower(gated_mlp_grads(policy), mesh, layout)(*md.place(args, mesh, layout))
    for g, w in zip(got, want):
        w = np.asarray(w.array)
        np.testing.assert_allclose(np.asarray(g.array), w, rtol=2e-4, atol=2e-4 * float(np.abs(w).max()))
    offloaded, kept = (md.explain(gated_mlp_grads(p), mesh, layout, *args) for p in (policy, base))
    host, moved = offloaded.memory["host"], offloaded.memory["transfers"]
    assert host > 0 and kept.memory["host"] == 0
    assert moved == {"to host": host, "to device": host}   # each residual out once and back once
    assert offloaded.memory["peak"] < kept.memory["peak"]   # device memory: what it moved is not there
    assert "host link" in offloaded.to_markdown()


def _scan_policy(report) -> str:
    (scan,) = [d for d in report.decisions() if d["op"].startswith("scan")]
    return scan["chosen"].rsplit("remat ", 1)[1]


def test_the_plan_offloads_activations_only_where_the_host_link_beats_recomputing():
    """On a GPU (abstract, the h100 profile) under a budget that keeping the activations (or the
    matmuls) does not meet: over a slow host link recomputing is faster; over a fast one the plan
    moves the matmuls to the host instead of recomputing them; with room for all it keeps them.
    A CPU's plan is never offered an offload (XLA:CPU keeps offloaded values in device memory)."""
    args, layout = _stack(abstract=True), md.Layout({"batch": "data"})
    mesh = md.Mesh.abstract({"data": 8}, platform="gpu")
    h100 = md.Hardware.profile("h100-80gb")
    slow, fast = (dataclasses.replace(h100, host_bandwidth=b) for b in (1e8, 1e15))
    step, budget = gated_mlp_grads("auto"), 3.6 * 2 ** 20   # under none's 4.4 MiB and dots' 3.7
    assert _scan_policy(md.explain(step, mesh, layout, *args, hardware=fast)) == "none"
    recomputed = md.explain(step, mesh, layout, *args, hardware=slow, memory_budget=budget)
    assert _scan_policy(recomputed) == "full", recomputed.decisions()
    offloaded = md.explain(step, mesh, layout, *args, hardware=fast, memory_budget=budget)
    assert _scan_policy(offloaded) == "offload-dots", offloaded.decisions()
    assert offloaded.memory["peak"] <= budget and offloaded.memory["host"] > 0
    assert "offload" in md.REMAT_AUTO_CHOICES and not any(p.startswith("offload") for p in remats.choices("cpu"))


# -- chosen: md.search weighs the optimizer state, and offloads it where only that fits ------------

def _search(budget, **kw):
    args = [md.named(jax.ShapeDtypeStruct(a.raw.shape, a.raw.dtype), a.dims, is_param=a.is_param)
            for a in gated_mlp_stack()]
    return md.search(gated_mlp_grads("none"), 8, *args, memory_budget=budget, hardware="h100-80gb", top=3,
                     dims=["batch"], **kw)


def test_a_search_counts_each_layouts_optimizer_state_and_offloads_it_only_where_nothing_else_fits():
    """AdamW's state (twice the parameters, 4 MiB per device here, replicated) on top of a step
    of 8.8 MiB: with 16 MiB the best layout keeps it on the device; with 11 MiB none does, and
    with ``offload=True`` the best keeps it in host memory, paying its trip each step."""
    roomy = _search("16MiB", optimizer_state=2.0, offload=True)
    assert str(roomy.best.layout) == "batch:data" and roomy.best.host_s == 0
    assert roomy.best.memory["optimizer"] == 4 * 2 ** 20
    assert roomy.best.memory["peak"] == _search("16MiB").best.memory["peak"] + 4 * 2 ** 20
    assert not _search("11MiB", optimizer_state=2.0).candidates   # on the device, nothing fits
    tight = _search("11MiB", optimizer_state=2.0, offload=True)
    best = tight.best
    assert str(best.layout) == "batch:data | offload optimizer", [c.why for c in tight.rejected]
    assert best.memory["peak"] * 1.1 <= 11 * 2 ** 20 and best.memory["host"] == 4 * 2 ** 20
    assert best.host_s == pytest.approx(2 * 4 * 2 ** 20 / 64e9)   # to the device and back, on PCIe Gen5
    assert "optimizer state to the device and back" in best.why


def test_a_search_streams_the_parameters_from_host_memory_only_where_the_state_offloaded_is_not_enough():
    """With 6 MiB, no layout fits even with AdamW's state in host memory (the parameters and their
    gradients, 2 MiB each, replicated, are over it with the step's activations); ``offload=True``
    then costs each layout again with its parameters in host memory too, each layer's slice brought
    to the device one layer ahead of its use: the best fits, paying explain's trips (2x the
    parameters in, and the one layer each pass fetches ahead of none, their gradients out) and the
    update's (the parameters and gradients in, the parameters out), and the state's; the step's
    trips cost only what the step's compute does not cover. Where the state's offload alone fits
    (11 MiB), the parameters stay."""
    assert not _search("6MiB", optimizer_state=2.0).candidates
    best = _search("6MiB", optimizer_state=2.0, offload=True).best
    params = 2 * 2 ** 20   # per device, replicated
    assert str(best.layout) == "batch:data | offload optimizer,params"
    assert best.memory["peak"] * 1.1 <= 6 * 2 ** 20
    assert best.memory["host"] == 2 * params + 2 * params     # the parameters, their gradients and the state
    ahead = 2 * params // 4   # one of the 4 layers' slices each pass, fetched ahead of no layer
    assert best.report.memory["transfers"] == {"to device": 2 * params + ahead, "to host": params}
    streamed = (3 * params + ahead) / 64e9   # the step's trips, under its compute where that is longer
    update_and_state = (3 * params + 2 * 2 * params) / 64e9
    assert best.host_s == pytest.approx(max(0.0, streamed - best.step_time.compute_s) + update_and_state)
    assert "parameters (each layer's slice fetched while the layer before computes) and optimizer state to the " \
           "device and back" in best.why
    assert "params" not in _search("11MiB", optimizer_state=2.0, offload=True).best.layout.offload
