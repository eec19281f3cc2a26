"""Communication is exactly what the rewriter table says, for the canonical layouts.

For each program: the compiled HLO (measured by ``hlo_comm``) has exactly the collectives the
rewriter promises, their bytes equal the analytic minimum (stated as a formula), ``md.explain``
predicts the same bytes per kind before compiling, and the result equals the unsharded reference.
Mesh: data=2 x model=4, float32 (4 bytes).
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

import meshdsl as md
from helpers import assert_same, bytes_by_kind, check_layout, explain_summary, hlo_summary

B, S, D, F, H, K = 8, 16, 32, 64, 8, 4
F32 = 4
DATA, MODEL = 2, 4


def ring_all_reduce(nbytes, n):
    return 2 * (n - 1) / n * nbytes


def ring_gather(full_bytes, n):  # all-gather (result), reduce-scatter (operand), all-to-all (operand)
    return (n - 1) / n * full_bytes


@pytest.fixture(scope="module")
def mesh():
    return md.Mesh({"data": DATA, "model": MODEL})


@pytest.fixture(scope="module")
def arrays():
    k = jax.random.split(jax.random.key(0), 8)
    return {
        "x2": md.named(jax.random.normal(k[0], (B, D)), "batch d_model"),
        "x3": md.named(jax.random.normal(k[1], (B, S, D)), "batch seq d_model"),
        "w1": md.named(jax.random.normal(k[2], (D, F)) / 4, "d_model d_ff"),
        "w2": md.named(jax.random.normal(k[3], (F, D)) / 4, "d_ff d_model"),
        "wq": md.named(jax.random.normal(k[4], (D, H, K)) / 4, "d_model heads d_kv"),
        "wk": md.named(jax.random.normal(k[5], (D, H, K)) / 4, "d_model heads d_kv"),
        "wv": md.named(jax.random.normal(k[6], (D, H, K)) / 4, "d_model heads d_kv"),
        "wo": md.named(jax.random.normal(k[7], (H, K, D)) / 4, "heads d_kv d_model"),
    }


def mlp(x, w1, w2):
    h = md.relu(md.einsum(x, w1, out=[*x.names[:-1], "d_ff"]))
    return md.einsum(h, w2, out=x.names)


def check_comm(fn, mesh, layout, args, expected, rtol=1e-5, **kw):
    """Equal to the reference; HLO bytes per kind == expected == md.explain's prediction (``kw``:
    md.lower's options, an objective)."""
    f = check_layout(fn, mesh, layout, *args, rtol=rtol, atol=rtol, **kw)
    hlo = hlo_summary(f, *args)
    report = md.explain(fn, mesh, layout, *args, **kw)
    assert bytes_by_kind(hlo) == pytest.approx(expected), hlo
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo)), (report.to_markdown(), hlo)
    return hlo, report


def test_megatron_mlp_forward_is_one_all_reduce_at_the_minimum(mesh, arrays):
    layout = md.Layout({"batch": "data", "d_ff": "model"})
    args = (arrays["x2"], arrays["w1"], arrays["w2"])
    out_block = B // DATA * D * F32
    hlo, report = check_comm(mlp, mesh, layout, args, {"all-reduce": ring_all_reduce(out_block, MODEL)})
    assert hlo["all-reduce"][0] == 1
    (rec,) = report.collectives
    assert rec.axes == ("model",) and rec.shape == (B // DATA, D) and rec.kind == "all-reduce"
    assert "einsum at test_communication.py" in rec.tensor  # the pending sum names its source


def test_sequence_parallel_mlp_is_one_gather_and_one_reduce_scatter(mesh, arrays):
    layout = md.Layout({"batch": "data", "seq": "model", "d_ff": "model"})

    def sp_mlp(x, w1, w2):
        whole = md.rename(x, {"seq": "seq_all"})         # all-gather when the MLP needs it whole
        return md.rename(mlp(whole, w1, w2), {"seq_all": "seq"})  # pending sum -> reduce-scatter

    full = B // DATA * S * D * F32
    hlo, _ = check_comm(sp_mlp, mesh, layout, (arrays["x3"], arrays["w1"], arrays["w2"]),
                        {"all-gather": ring_gather(full, MODEL), "reduce-scatter": ring_gather(full, MODEL)})
    assert hlo["all-gather"][0] == 1 and hlo["reduce-scatter"][0] == 1 and "all-reduce" not in hlo


def test_moe_dispatch_rename_moving_the_split_is_one_all_to_all(mesh):
    G, E, C = 8, 4, 2
    t = md.named(jax.random.normal(jax.random.key(1), (G, E, C, D)), "group experts_all capacity d_model")
    layout = md.Layout({"group": "data", "experts": "data"})

    def dispatch(t):
        return md.rename(t, {"group": "group_all", "experts_all": "experts"})

    local = G // DATA * E * C * D * F32
    hlo, _ = check_comm(dispatch, mesh, layout, (t,), {"all-to-all": ring_gather(local, DATA)})
    assert hlo["all-to-all"][0] == 1


@pytest.mark.parametrize("offset, permutes, rows", [(1, 1, 1), (-1, 1, 1), (3, 1, 3), (5, 2, 4), (4, 1, 4)])
def test_shift_on_a_split_dim_is_collective_permute_of_the_boundary(mesh, arrays, offset, permutes, rows):
    """Blocks of 4 along seq: offset 1 sends one row, 3 sends three, 5 sends 3 + 1 rows from two
    devices, 4 sends one whole block (the plan of fewest bytes: with blocks this small the step's
    time takes one all-gather, one collective's latency, over two permutes, as the next test pins)."""
    layout = md.Layout({"seq": "model", "batch": "data"})
    hlo, _ = check_comm(lambda x: md.shift(x, "seq", offset), mesh, layout, (arrays["x3"],),
                        {"collective-permute": B // DATA * rows * D * F32}, objective="bytes")
    assert hlo["collective-permute"][0] == permutes


@pytest.mark.parametrize("offset, kept", [(-14, 2), (13, 3), (15, 1)])
def test_a_shift_into_a_whole_result_moves_only_the_rows_that_stay(mesh, arrays, offset, kept):
    """A parameter stored split over model (4 devices, blocks of 4 along seq) shifted into a result
    holding seq whole: the rows that stay lie on one device, so they are summed zero-filled (one
    all-reduce of those rows), not the dim gathered (4 rows a device). Over 2 devices (batch over
    data, blocks of 4) gathering each device's part of them moves as little: one all-gather of
    the widest part."""
    w = md.param(arrays["x3"])
    per_row = B // DATA * D * F32
    layout = md.Layout({"batch": "data"}, params={"seq": "model"})
    hlo, _ = check_comm(lambda w: md.shift(w, "seq", offset), mesh, layout, (w,),
                        {"all-reduce": ring_all_reduce(kept * per_row, MODEL)}, objective="bytes")
    assert hlo["all-reduce"][0] == 1
    hlo, _ = check_comm(lambda w: md.shift(w, "batch", -6), mesh, md.Layout({}, params={"batch": "data"}), (w,),
                        {"all-gather": ring_gather(DATA * 2 * S * D * F32, DATA)}, objective="bytes")
    assert hlo["all-gather"][0] == 1


@pytest.mark.parametrize("start, size", [(1, 2), (13, 3)])
def test_a_slice_into_a_whole_result_moves_only_the_rows_it_reads(mesh, arrays, start, size):
    """md.slice of a parameter stored split over model into a result holding the dim whole, the
    rows read on one device: those rows summed zero-filled (one all-reduce), not the dim gathered."""
    layout = md.Layout({"batch": "data"}, params={"seq": "model"})
    hlo, _ = check_comm(lambda w: md.slice(w, "seq", start, size), mesh, layout, (md.param(arrays["x3"]),),
                        {"all-reduce": ring_all_reduce(size * B // DATA * D * F32, MODEL)}, objective="bytes")
    assert sum(count for count, *_ in hlo.values()) == 1


def test_a_shift_from_two_devices_takes_one_gather_where_latency_outweighs_the_bytes(mesh, arrays):
    """Offset 5 over blocks of 4 needs rows from two devices: two permutes (2 KiB) or one
    all-gather (6 KiB). On the CPU profile (10 us a collective, 230 GB/s) the gather's one latency
    is the shorter step; on a link a thousand times slower per byte the permutes are."""
    layout = md.Layout({"seq": "model", "batch": "data"})
    shift = lambda x: md.shift(x, "seq", 5)  # noqa: E731
    hlo, _ = check_comm(shift, mesh, layout, (arrays["x3"],), {"all-gather": 3 * B // DATA * 4 * D * F32})
    assert hlo["all-gather"][0] == 1
    slow = md.Hardware.profile("cpu")
    slow = dataclasses.replace(slow, interconnect={k: dataclasses.replace(v, bandwidth=v.bandwidth / 1000)
                                                   for k, v in slow.interconnect.items()})
    hlo, _ = check_comm(shift, mesh, layout, (arrays["x3"],), {"collective-permute": B // DATA * 4 * D * F32},
                        hardware=slow)
    assert hlo["collective-permute"][0] == 2


def test_zero3_gathers_forward_and_reduce_scatters_gradients(mesh, arrays):
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"})
    w1, w2 = md.param(arrays["w1"]), md.param(arrays["w2"])

    def grads(x, w1, w2):
        return jax.grad(lambda w1, w2: md.sum(md.square(mlp(x, w1, w2))).array, argnums=(0, 1))(w1, w2)

    weight = D * F * F32
    hlo, report = check_comm(grads, mesh, layout, (arrays["x2"], w1, w2),
                             {"all-gather": 2 * ring_gather(weight, DATA),
                              "reduce-scatter": 2 * ring_gather(weight, DATA)}, rtol=1e-4)
    assert "all-reduce" not in hlo
    phases = {(r.kind, r.phase) for r in report.collectives}
    assert phases == {("all-gather", "forward"), ("reduce-scatter", "backward")}
    out = md.lower(grads, mesh, layout)(arrays["x2"], w1, w2)
    assert all(g.is_param for g in out)  # gradients of parameters come back in the storage layout
    assert out[0].array.sharding.spec == layout.spec(w1.dims, mesh, storage=True)


def test_zero3_auto_moves_activations_when_they_are_smaller_than_the_weights(mesh, arrays):
    """param_gather="auto", batch of 8 rows, weights [32, 64] stored d_model:data: moving the
    activations moves fewer bytes than gathering the weights (the bytes objective). The whole-program plan gathers x (8 rows,
    512 B), contracts it with w1 where w1 is stored (h pending over data, all-reduced), and
    contracts h with w2 where w2 is stored (y split over d_model); backward, dh is all-reduced once
    and both weight gradients are born in the storage layout. No weight moves."""
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"})
    w1, w2 = md.param(arrays["w1"]), md.param(arrays["w2"])

    def grads(x, w1, w2):
        return jax.grad(lambda w1, w2: md.sum(md.square(mlp(x, w1, w2))).array, argnums=(0, 1))(w1, w2)

    args = (arrays["x2"], w1, w2)
    f = md.lower(grads, mesh, layout, param_gather="auto", objective="bytes")
    assert_same(f(*args), grads(*args), 1e-4, 1e-4)
    hlo = hlo_summary(f, *args)
    h, x = B * F * F32, B * D * F32
    expected = {"all-gather": ring_gather(x, DATA), "all-reduce": 2 * ring_all_reduce(h, DATA)}
    assert bytes_by_kind(hlo) == pytest.approx(expected), hlo
    report = md.explain(grads, mesh, layout, *args, param_gather="auto", objective="bytes")
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    keep = md.explain(grads, mesh, layout, *args)
    assert report.total_bytes < 0.35 * keep.total_bytes
    assert f(*args)[0].array.sharding.spec == layout.spec(w1.dims, mesh, storage=True)


def test_zero3_forward_only_gathers(mesh, arrays):
    layout = md.Layout({"batch": "data"}, params={"d_model": "data"})
    args = (arrays["x2"], md.param(arrays["w1"]), md.param(arrays["w2"]))
    hlo, _ = check_comm(mlp, mesh, layout, args, {"all-gather": 2 * ring_gather(D * F * F32, DATA)})
    assert hlo["all-gather"][0] == 2


def test_two_partial_sums_added_are_reduced_once(mesh, arrays):
    layout = md.Layout({"batch": "data", "d_ff": "model"})

    def two(x, w1, w2):
        a = md.einsum(md.einsum(x, w1, out="batch d_ff"), w2, out="batch d_model")
        b = md.einsum(md.relu(md.einsum(x, w1, out="batch d_ff")), w2, out="batch d_model")
        return md.tanh(a + b)

    hlo, _ = check_comm(two, mesh, layout, (arrays["x2"], arrays["w1"], arrays["w2"]),
                        {"all-reduce": ring_all_reduce(B // DATA * D * F32, MODEL)})
    assert hlo["all-reduce"][0] == 1


def test_whole_to_split_is_a_local_slice(mesh, arrays):
    layout = md.Layout({"seq": "model", "batch": "data"})
    x_whole = md.named(arrays["x3"].array, "batch seq_all d_model")  # seq_all: no rule, whole
    hlo, _ = check_comm(lambda x: md.rename(md.tanh(x), {"seq_all": "seq"}), mesh, layout, (x_whole,), {})
    assert hlo == {}


def test_elementwise_ops_compute_where_the_operands_are(mesh, arrays):
    """tanh of a renamed (now unplaced) dim is computed on the blocks the devices hold: no gather."""
    layout = md.Layout({"seq": "model", "batch": "data"})

    def f(x):
        return md.rename(md.tanh(md.rename(x, {"seq": "seq_all"})) * 2.0, {"seq_all": "seq"})

    hlo, _ = check_comm(f, mesh, layout, (arrays["x3"],), {})
    assert hlo == {}


def attention_projections(x, wq, wk, wv, wo):
    q = md.einsum(x, wq, out="batch seq heads d_kv")
    k = md.einsum(x, wk, out="batch seq heads d_kv")
    v = md.einsum(x, wv, out="batch seq heads d_kv")
    logits = md.einsum(q, md.rename(k, {"seq": "kv_seq"}), out="batch heads seq kv_seq")
    w = md.softmax(logits, "kv_seq")
    o = md.einsum(w, md.rename(v, {"seq": "kv_seq"}), out="batch seq heads d_kv")
    return md.einsum(o, wo, out="batch seq d_model")


def test_megatron_attention_backward_reduces_the_input_gradient_once(mesh, arrays):
    """GSPMD all-reduces the q, k and v input cotangents separately (1.64x); we add them first."""
    layout = md.Layout({"batch": "data", "heads": "model"})
    ws = [arrays[n] for n in ("wq", "wk", "wv", "wo")]

    def input_grad(x, *ws):
        return jax.grad(lambda x: md.sum(md.square(attention_projections(x, *ws))).array)(x)

    act = B // DATA * S * D * F32
    hlo, report = check_comm(input_grad, mesh, layout, (arrays["x3"], *ws),
                             {"all-reduce": 2 * ring_all_reduce(act, MODEL)}, rtol=1e-4)
    backward = [r for r in report.collectives if r.phase == "backward"]
    assert [(r.kind, r.axes) for r in backward] == [("all-reduce", ("model",))]


def test_pending_sum_flows_through_an_einsum_linear_in_it(mesh):
    """MoE combine after a d_ff-split expert FFN: reduce the small combined result, not the big one."""
    k = jax.random.split(jax.random.key(2), 3)
    h = md.named(jax.random.normal(k[0], (4, 8, F)), "experts capacity d_ff")
    w = md.named(jax.random.normal(k[1], (4, F, D)) / 8, "experts d_ff d_model")
    c = md.named(jax.random.normal(k[2], (4, 8, 2)), "experts capacity tokens")

    def combine(h, w, c):
        return md.einsum(md.einsum(h, w, out="experts capacity d_model"), c, out="tokens d_model")

    hlo, _ = check_comm(combine, mesh, md.Layout({"d_ff": "model"}), (h, w, c),
                        {"all-reduce": ring_all_reduce(2 * D * F32, MODEL)}, rtol=1e-4)
    assert hlo["all-reduce"][0] == 1


def test_zero1_optimizer_update_stays_in_the_storage_layout():
    """ZeRO-1 by hand: the weight is not marked md.param (replicated), the optimizer state is
    (stored split over data). The state is never gathered: the gradient is sliced to it and only the
    new weights are gathered. The weight's gradient is all-reduced by the backward pass (the
    transpose of using a replicated weight on every device), so the step moves 3 Psi, not the 2 Psi
    of the params= layout that stores the weight split too (test_parameters_and_gradients_keep_the_promises.py::test_a_fused_training_step_moves_the_gradient_reduction_alone)."""
    mesh = md.Mesh({"data": 8})
    k = jax.random.split(jax.random.key(3), 2)
    x = md.named(jax.random.normal(k[0], (16, D)), "batch d_model")
    w = md.named(jax.random.normal(k[1], (D, F)) * 0.1, "d_model d_ff")
    m, v = md.param(md.named(jnp.zeros((D, F)), "d_model d_ff")), md.param(md.named(jnp.ones((D, F)), "d_model d_ff"))

    def step(w, m, v, x):
        g = jax.grad(lambda w: md.sum(md.square(md.einsum(x, w, out="batch d_ff"))).array)(w)
        m, v = md.param(0.9 * m + 0.1 * g), md.param(0.99 * v + 0.01 * g * g)
        return w - 1e-3 * m / (md.sqrt(v) + 1e-8), m, v

    layout = md.Layout({"batch": "data"}, params={"d_model": "data"})
    weight = D * F * F32
    hlo, _ = check_comm(step, mesh, layout, (w, m, v, x),
                        {"all-reduce": ring_all_reduce(weight, 8), "all-gather": ring_gather(weight, 8)}, rtol=1e-4)
    assert hlo["all-gather"][0] == 1
