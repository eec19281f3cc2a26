"""Dropless experts (``md.expert_ffn``, ``md.ragged_dot``, ``layers.DroplessMoE``): every token reaches
each expert it chose under every layout; expert parallelism moves the rows in one all-to-all each
way (plus one of the counts), exactly as ``md.explain`` says; nothing is dropped even when every
token picks the same experts; one test per error message."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import assert_same, explain_summary, explain_vs_hlo, hlo_summary, raises

from meshdsl import hlo_comm

import meshdsl as md
import meshdsl.layers as L
from meshdsl.ops import grouped

B, S, D, F, E, K = 8, 8, 16, 24, 8, 2
MESH = {"data": 4, "model": 2}


def _inputs(seed=0, same_experts=False):
    rng = np.random.default_rng(seed)
    x = md.named(rng.normal(size=(B, S, D)).astype(np.float32), "batch seq d_model")
    idx = np.stack([rng.permutation(E)[:K] for _ in range(B * S)]).reshape(B, S, K)
    if same_experts:   # every token picks experts 0 and 1: one device gets every row
        idx = np.broadcast_to(np.arange(K), (B, S, K)).copy()
    index = md.named(idx.astype(np.int32), "batch seq choice")
    def kernel(dims, *shape):
        return md.param(md.named((rng.normal(size=shape) * 0.2).astype(np.float32), dims))
    ws = [kernel("experts d_model d_ff", E, D, F), kernel("experts d_model d_ff", E, D, F),
          kernel("experts d_ff d_model", E, F, D)]
    return x, index, ws


def _reference(x, index, ws, act):
    """Per token and choice, the chosen expert's FFN in numpy."""
    xs, idx = np.asarray(x.array), np.asarray(index.array)
    w = [np.asarray(v.array) for v in ws]
    out = np.zeros((B, S, K, w[-1].shape[-1]))
    for b, s, c in np.ndindex(B, S, K):
        e = idx[b, s, c]
        if len(w) == 1:
            out[b, s, c] = xs[b, s] @ w[0][e]
        elif len(w) == 2:
            out[b, s, c] = act(xs[b, s] @ w[0][e]) @ w[1][e]
        else:
            out[b, s, c] = (act(xs[b, s] @ w[0][e]) * (xs[b, s] @ w[1][e])) @ w[2][e]
    return out


def _silu(v):
    return v / (1 + np.exp(-v))


@pytest.mark.parametrize("kernel", ["ragged", "tiled"])
@pytest.mark.parametrize("kernels", [1, 2, 3])
def test_each_token_runs_through_the_experts_it_chose(kernels, kernel):
    """Kernels are matched by their dims' names, in any order; both local grouped matmuls."""
    x, index, ws = _inputs()
    given = [ws[0], md.transpose(ws[1], "d_ff experts d_model"), ws[2]]
    ws, given = ({1: v[:1], 2: [v[0], v[2]], 3: v}[kernels] for v in (ws, given))
    out = md.expert_ffn(x, index, given, activation="silu", kernel=kernel) if kernels > 1 else \
        md.ragged_dot(x, given[0], index, kernel=kernel)
    assert out.names == ("batch", "seq", "choice", "d_ff" if kernels == 1 else "d_model")
    np.testing.assert_allclose(np.asarray(out.array), _reference(x, index, ws, _silu), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("sizes", [[0, 37, 0, 3, 0, 0, 60, 0], [100, 0, 0, 0, 0, 0, 0, 0], [1] * 8, [0] * 8])
def test_the_tiled_kernel_equals_the_ragged_one_for_any_group_sizes(sizes):
    """Empty groups, one group holding every row, rows past the groups (zeros), tiles cut at
    group ends: values and gradients agree."""
    rng = np.random.default_rng(3)
    rows = jnp.asarray(rng.normal(size=(100, D)).astype(np.float32))
    kernels = [jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in [(E, D, F), (E, D, F), (E, F, D)]]
    sizes = jnp.asarray(sizes, jnp.int32)

    def run(kernel, rows, kernels):
        return getattr(grouped, kernel)(rows, sizes, kernels, jax.nn.silu)

    np.testing.assert_allclose(run("tiled", rows, kernels), run("ragged", rows, kernels), rtol=1e-4, atol=1e-4)
    grads = [jax.grad(lambda r, k: jnp.sum(run(name, r, k) ** 2), argnums=(0, 1))(rows, kernels)
             for name in ("tiled", "ragged")]
    for a, b in zip(jax.tree_util.tree_leaves(grads[0]), jax.tree_util.tree_leaves(grads[1])):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-3)


def _ffn(x, index, w0, w1, w2):
    return md.expert_ffn(x, index, [w0, w1, w2], distinct=True)


def _grads(x, index, w0, w1, w2):
    return jax.grad(lambda x, *ws: md.sum(md.square(_ffn(x, index, *ws))).array, argnums=(0, 1, 2, 3))(x, w0, w1, w2)


LAYOUTS = {
    "data": {"batch": "data"},
    "expert parallel": {"batch": "data", "experts": "data"},
    "expert parallel, Megatron inside": {"batch": "data", "experts": "data", "d_ff": "model"},
    "experts over tokens whole there": {"batch": "data", "experts": "model"},
    "tokens over two axes": {"batch": "data", "seq": "model", "experts": "data"},
    "d_model split": {"batch": "data", "experts": "data", "d_model": "model"},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("same_experts", [False, True])
def test_values_and_gradients_equal_the_unsharded_ones(name, same_experts):
    x, index, ws = _inputs(same_experts=same_experts)
    mesh, layout = md.Mesh(MESH), md.Layout(LAYOUTS[name])
    assert_same(md.lower(_ffn, mesh, layout)(x, index, *ws), _ffn(x, index, *ws))
    assert_same(md.lower(_grads, mesh, layout)(x, index, *ws), _grads(x, index, *ws), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("layout", [md.Layout({"batch": "data"}, params={"experts": "data"}),
                                    md.Layout({"batch": "data", "experts": "data"}, params={"d_model": "model"})],
                         ids=["ZeRO-3 over the experts", "expert parallel, ZeRO-3 over d_model"])
def test_zero3_storage_of_the_expert_kernels_computes_the_same(layout):
    x, index, ws = _inputs()
    mesh = md.Mesh(MESH)
    assert_same(md.lower(_ffn, mesh, layout)(x, index, *ws), _ffn(x, index, *ws))
    assert_same(md.lower(_grads, mesh, layout)(x, index, *ws), _grads(x, index, *ws), rtol=1e-4, atol=1e-4)


def test_expert_parallelism_is_one_all_to_all_of_the_rows_each_way():
    """``batch: data, experts: data``: the rows go out in one all-to-all of a static buffer of
    ``tokens * min(top_k, local experts)`` rows per destination, the counts in one small one, the
    results come back in one; explain predicts the compiled program byte for byte."""
    x, index, ws = _inputs()
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data", "experts": "data"})
    n, tokens, held = 8, B * S // 8, E // 8
    rows = (n - 1) / n * n * tokens * min(K, held) * D * 4
    counts = (n - 1) / n * n * held * 4
    report = md.explain(_ffn, mesh, layout, x, index, *ws, objective="bytes")
    want = {"all-to-all": (3, pytest.approx(2 * rows + counts))}
    assert explain_summary(report) == want
    assert hlo_summary(md.lower(_ffn, mesh, layout, objective="bytes"), x, index, *ws) == want
    assert {r.tensor for r in report.collectives} == {
        "[batch seq choice] rows sent to their experts", "[batch seq choice] rows back from their experts",
        "rows per expert"}
    e, h = explain_vs_hlo(_grads, mesh, layout, x, index, *ws, objective="bytes")
    assert e == h and e == {"all-to-all": pytest.approx(4 * rows + counts)}


def test_experts_split_where_the_tokens_are_whole_leave_a_partial_sum():
    x, index, ws = _inputs()
    mesh, layout = md.Mesh(MESH), md.Layout({"batch": "data", "experts": "model"})
    report = md.explain(_ffn, mesh, layout, x, index, *ws, objective="bytes")
    out_bytes = B * S * K * D * 4 // 4     # the result, [batch/4 seq choice d_model], summed over model
    assert explain_summary(report) == {"all-reduce": (1, pytest.approx(2 * (2 - 1) / 2 * out_bytes))}


def test_an_expert_number_out_of_range_gives_zeros():
    x, index, ws = _inputs()
    bad = md.named(np.where(np.asarray(index.array) == 3, E + 5, np.asarray(index.array)).astype(np.int32),
                   "batch seq choice")
    got = np.asarray(md.lower(_ffn, md.Mesh({"data": 8}), md.Layout({"batch": "data", "experts": "data"}),
                              objective="bytes")(x, bad, *ws).array)
    want = _reference(x, index, ws, _silu)
    off = np.asarray(bad.array) >= E
    assert np.all(got[off] == 0)
    np.testing.assert_allclose(got[~off], want[~off], rtol=1e-5, atol=1e-5)


# -- the layer ----------------------------------------------------------------------------------------------

def _layer(**kw):
    return L.DroplessMoE(md.Dim("d_model", D), md.Dim("d_ff", F), md.Dim("experts", E), rngs=nnx.Rngs(0), **kw)


def test_topk_of_softmax_normalised_equals_softmax_of_topk():
    x = _inputs()[0]
    a, b = _layer(order="softmax-topk", normalize=True), _layer(order="topk-softmax")
    assert_same(a(x)[0], b(x)[0])


def test_the_layer_is_the_gated_sum_of_its_chosen_experts_plus_the_shared_one():
    x = _inputs()[0]
    moe = _layer(top_k=2, normalize=False, shared_d_ff=md.Dim("d_shared", 12))
    y, metrics = moe(x)
    xs = np.asarray(x.array)
    logits = xs @ np.asarray(moe.router.kernel.get_value().array)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, -1, kind="stable")[..., :2]
    w = [np.asarray(getattr(moe.experts, n).kernel.get_value().array) for n in ("wi_0", "wi_1", "wo")]
    sw = [np.asarray(getattr(moe.shared, n).kernel.get_value().array) for n in ("wi_0", "wi_1", "wo")]
    gate = np.asarray(moe.shared_gate.kernel.get_value().array)[:, 0]
    want = np.zeros_like(xs)
    for b, s in np.ndindex(B, S):
        t = xs[b, s]
        for e in top[b, s]:
            want[b, s] += probs[b, s, e] * ((_silu(t @ w[0][e]) * (t @ w[1][e])) @ w[2][e])
        want[b, s] += 1 / (1 + np.exp(-t @ gate)) * ((_silu(t @ sw[0]) * (t @ sw[1])) @ sw[2])
    np.testing.assert_allclose(np.asarray(y.array), want, rtol=1e-4, atol=1e-5)
    f = (np.eye(E)[top]).mean((0, 1))                                   # [choice, experts]
    np.testing.assert_allclose(float(metrics["load_balancing_loss"].array), E * (f * probs.mean((0, 1))).sum(),
                               rtol=1e-5)
    assert float(metrics["dropped_fraction"].array) == 0.0
    np.testing.assert_allclose(np.asarray(metrics["expert_load"].array), f.sum(0) / 2, rtol=1e-6)


def test_the_balance_bias_moves_the_choice_not_the_gates():
    x = _inputs()[0]
    moe = _layer(balance_bias=True, normalize=False)
    y0, m0 = moe(x)
    bias = moe.balanced_bias(m0["expert_load"], rate=1.0)
    load = np.asarray(m0["expert_load"].array)
    np.testing.assert_allclose(np.asarray(bias.array), np.sign(load.mean() - load))
    moe.bias.set_value(md.named(np.where(np.arange(E) == 5, 10.0, 0.0).astype(np.float32), "expert_choice"))
    gates, index, _, probs = moe.route(x)
    idx, p = np.asarray(index.array), np.asarray(probs.array)
    assert np.all(idx[..., 0] == 5)                                      # the bias decides the choice ...
    np.testing.assert_allclose(np.asarray(gates.array)[..., 0], p[..., 5], rtol=1e-6)   # ... never the gate


def test_the_layer_under_expert_parallelism_equals_the_unsharded_layer():
    x = _inputs()[0]
    moe = _layer(top_k=2, shared_d_ff=md.Dim("d_shared", 12))

    def loss(m, x):
        y, metrics = m(x)
        return md.sum(md.square(y)).array + metrics["load_balancing_loss"].array

    def grads(m, x):
        graphdef, state = nnx.split(m)
        return jax.grad(lambda s, x: loss(nnx.merge(graphdef, s), x), argnums=(0, 1))(state, x)

    for layout in ({"batch": "data", "experts": "data"}, {"batch": "data", "experts": "data", "d_ff": "model"}):
        f = md.lower(grads, md.Mesh(MESH), md.Layout(layout))
        want, got = grads(moe, x), f(moe, x)
        for a, b in zip(jax.tree_util.tree_leaves(got, is_leaf=lambda v: isinstance(v, md.NamedArray)),
                        jax.tree_util.tree_leaves(want, is_leaf=lambda v: isinstance(v, md.NamedArray))):
            assert_same(a, b, rtol=1e-4, atol=1e-5)


# -- one test per error message --------------------------------------------------------------------------

ERRORS = {   # each mistake: (call, what the message says)
    "kernel count": (lambda x, i, ws: md.expert_ffn(x, i, ws + ws), "kernels must be one, two or three"),
    "unknown activation": (lambda x, i, ws: md.expert_ffn(x, i, ws, activation="slu"), "activation must be one of"),
    "index not integers": (lambda x, i, ws: md.expert_ffn(x, i.astype(jnp.float32), ws), "must be integers"),
    "kernel without the experts dim": (lambda x, i, ws: md.expert_ffn(x, i, ws, experts="expert"),
                                       "must be \\[expert, d_in, d_out\\]"),
    "no choice dim": (lambda x, i, ws: md.expert_ffn(x, md.rename(i, {"choice": "seq2"}), ws, choice="choices"),
                      "cannot tell the choice dim"),
    "x with two feature dims": (lambda x, i, ws: md.expert_ffn(md.rename(x, {"seq": "pos"}), md.rename(i, {"seq": "pos2"}),
                                                               ws, choice="choice"), "one feature dim"),
    "gate and up kernels differ": (lambda x, i, ws: md.expert_ffn(x, i, [ws[0], md.rename(ws[1], {"d_ff": "d_hid"}), ws[2]]),
                                   "must have the same dims"),
    "last kernel misses the hidden dim": (lambda x, i, ws: md.expert_ffn(x, i, [ws[0], md.rename(ws[2], {"d_ff": "d_hid"})]),
                                          "must contract the hidden dim"),
    "output dim is an index dim": (lambda x, i, ws: md.ragged_dot(x, md.rename(ws[0], {"d_ff": "seq"}), i),
                                   "output dim 'seq'"),
    "unknown kernel": (lambda x, i, ws: md.expert_ffn(x, i, ws, kernel="dense"), "kernel must be one of"),
    "unknown exchange": (lambda x, i, ws: md.expert_ffn(x, i, ws, exchange="sparse"), "exchange must be one of"),
}


@pytest.mark.parametrize("mistake", list(ERRORS))
def test_each_mistake_is_one_shape_error_naming_it(mistake):
    call, message = ERRORS[mistake]
    x, index, ws = _inputs()
    with raises(md.ShapeError, message):
        call(x, index, ws)


def test_error_layer_options():
    with raises(md.MeshDSLError, "order must be one of", eager=True):   # (nnx.Rngs compiles its seed)
        _layer(order="sigmoid")
    with raises(md.MeshDSLError, "top_k=9 must be in 1..8", eager=True):
        _layer(top_k=9)
    with raises(md.MeshDSLError, "balance_bias=False", eager=True):
        _layer().balanced_bias(md.zeros("experts:8"))


# -- in the search --------------------------------------------------------------------------------------

def test_the_search_weighs_expert_parallelism_and_megatron_inside_the_experts():
    """``md.search`` over a dropless layer's training step: layouts putting ``experts`` on the
    tokens' axis (expert parallelism), ``d_ff`` split inside each expert, and both, are all
    candidates, each costed by the op's own strategy (the exchange's all-to-alls priced: at these
    widths, kernels large against the tokens, they are what the plan takes)."""
    moe = L.DroplessMoE(md.Dim("d_model", 64), md.Dim("d_ff", 256), md.Dim("experts", E), rngs=nnx.Rngs(0))
    x = md.named(np.random.default_rng(1).normal(size=(B, S, 64)).astype(np.float32), "batch seq d_model")

    def grads(m, x):
        graphdef, state = nnx.split(m)
        return jax.grad(lambda s, x: md.sum(md.square(nnx.merge(graphdef, s)(x)[0])).array)(state, x)

    result = md.search(grads, 8, moe, x, dims=["batch", "experts", "d_ff"], top=100)
    layouts = {(str(c.mesh), str(c.layout)): c for c in result.candidates}
    ep = layouts[("data:8", "batch:data;experts:data")]
    assert ep.bytes["all-to-all"]["count"] == 4 and set(ep.bytes) == {"all-to-all", "all-reduce"}
    assert ("data:2 x model:4", "batch:data;experts:data;d_ff:model") in layouts
    assert ("data:8", "d_ff:data") in layouts


def test_the_compilers_plan_computes_the_same():
    """``backend="gspmd"``: the op on global arrays, XLA partitioning the sort and the matmuls."""
    x, index, ws = _inputs()
    layout = md.Layout({"batch": "data", "experts": "data"})
    f = md.lower(_ffn, md.Mesh(MESH), layout, backend="gspmd")
    assert_same(f(x, index, *ws), _ffn(x, index, *ws))


# -- a stated exchange bound ------------------------------------------------------------------------------

def _bounded(factor):
    def f(x, index, w0, w1, w2):
        return md.expert_ffn(x, index, [w0, w1, w2], distinct=True, exchange_factor=factor)
    return f


def test_a_stated_exchange_bound_moves_fewer_bytes_and_drops_nothing_it_can_hold():
    """Balanced routing (every expert 16 of the 128 assignments; each device's 8 tokens spread
    evenly): a buffer of 2x the balanced rows holds them all - the unsharded values, nothing
    dropped - and moves half the never-dropping buffer's bytes."""
    x, _, ws = _inputs()
    idx = (np.arange(B * S * K).reshape(B, S, K) * 3) % E
    index = md.named(idx.astype(np.int32), "batch seq choice")
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data", "experts": "data"})
    out, dropped = md.lower(_bounded(2.0), mesh, layout, objective="bytes")(x, index, *ws)
    assert float(dropped.array) == 0.0
    assert_same(out, _ffn(x, index, *ws))
    fewer = md.explain(_bounded(2.0), mesh, layout, x, index, *ws, objective="bytes").summary()["all-to-all"]["bytes"]
    worst = md.explain(_ffn, mesh, layout, x, index, *ws, objective="bytes").summary()["all-to-all"]["bytes"]
    rows, counts = 2 * (7 / 8) * 8 * 4 * D * 4, (7 / 8) * 8 * 1 * 4     # 2 x 8 tokens x 2 / 8 devices = 4 rows each
    assert fewer == pytest.approx(rows + counts) and worst == pytest.approx(2 * (7 / 8) * 8 * 8 * D * 4 + counts)


def test_assignments_past_a_stated_bound_are_counted_never_silently_dropped():
    """Every token picks experts 0 and 1 (devices 0 and 1): with a buffer of 1x the balanced rows
    (2), each device sends each of them its first two tokens' rows; the other 12 of its 16
    assignments are zeros, and counted."""
    x, index, ws = _inputs(same_experts=True)
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data", "experts": "data"})
    out, dropped = md.lower(_bounded(1.0), mesh, layout, objective="bytes")(x, index, *ws)
    assert float(dropped.array) == pytest.approx(12 / 16)
    got, want = np.asarray(out.array), _reference(x, index, ws, _silu)
    kept = np.zeros((B, S, K), bool)
    kept[:, :2, :] = True                     # each device's (batch row's) first two tokens fit
    np.testing.assert_allclose(got[kept], want[kept], rtol=1e-5, atol=1e-5)
    assert np.all(got[~kept] == 0)


# -- the ragged exchange: only the rows (GPU, TPU) ---------------------------------------------------------

def _exchanged(exchange, factor=None):
    def f(x, index, w0, w1, w2):
        return md.expert_ffn(x, index, [w0, w1, w2], distinct=True, exchange=exchange, exchange_factor=factor)
    return f


@pytest.mark.parametrize("layout", [{"batch": "data", "experts": "data"},
                                    {"batch": "data", "seq": "model", "experts": ("model", "data")}],
                         ids=["one axis", "two axes"])
@pytest.mark.parametrize("same_experts", [False, True])
def test_the_ragged_exchange_computes_the_unsharded_values_and_gradients(same_experts, layout):
    """``exchange="ragged"`` on XLA:CPU (which has no ragged all-to-all: the padding is zeroed and
    the blocks go whole): values and gradients are the unsharded ones, also when every token
    picks the same experts, with the experts over one mesh axis or two."""
    x, index, ws = _inputs(same_experts=same_experts)
    f = _exchanged("ragged")
    grads = lambda x, index, *ws: jax.grad(lambda x, *ws: md.sum(md.square(f(x, index, *ws))).array,   # noqa: E731
                                           argnums=(0, 1, 2, 3))(x, *ws)
    mesh, layout = md.Mesh({"data": 4, "model": 2}), md.Layout(layout)
    tensors = {r.tensor for r in md.explain(grads, mesh, layout, x, index, *ws, objective="bytes").collectives}
    assert "[batch seq choice] rows sent to their experts" in tensors        # (exchanged, not gathered)
    assert_same(md.lower(f, mesh, layout, objective="bytes")(x, index, *ws), _ffn(x, index, *ws))
    assert_same(md.lower(grads, mesh, layout, objective="bytes")(x, index, *ws), _grads(x, index, *ws),
                rtol=1e-4, atol=1e-4)


def _ragged_reference(operands, outputs, args):
    """jax's documented semantics of ``ragged_all_to_all`` (its docstring's loops), in numpy:
    ``operands[d]``, ``outputs[d]`` and ``args[d]`` (the four offset and size arrays) per device."""
    n = len(operands)
    results = [o.copy() for o in outputs]
    for src in range(n):
        in_off, send, out_off, _ = (np.asarray(a) for a in args[src])
        for i in range(n):   # one slice per destination
            results[i][out_off[i]:out_off[i] + send[i]] = operands[src][in_off[i]:in_off[i] + send[i]]
    for dst in range(n):     # what each receiver expects to get agrees with what was sent
        recv = np.asarray(args[dst][3])
        assert all(recv[s] == np.asarray(args[s][1])[dst] for s in range(n))
    return results


def test_the_ragged_arguments_deliver_each_block_to_its_place():
    """The offsets and sizes the ragged exchange passes to ``jax.lax.ragged_all_to_all`` (run by
    jax's documented semantics, as XLA:CPU cannot run the collective) put block ``s`` of device
    ``d``'s result = the first ``sizes[s, d]`` rows of block ``d`` of device ``s``, then zeros:
    what the padded exchange delivers."""
    from meshdsl.rewrite.collectives import ragged_arguments
    n, block, rng = 4, 5, np.random.default_rng(3)
    sizes = rng.integers(0, block + 1, size=(n, n))          # [source, destination]
    operands = [rng.normal(size=(n * block, 3)) for _ in range(n)]
    args = [ragged_arguments(n, block, d, jnp.asarray(sizes[d]), jnp.asarray(sizes[:, d])) for d in range(n)]
    got = _ragged_reference(operands, [np.zeros((n * block, 3))] * n, args)
    for d, s in np.ndindex(n, n):
        want = np.zeros((block, 3))
        want[:sizes[s, d]] = operands[s][d * block:d * block + sizes[s, d]]
        np.testing.assert_array_equal(got[d][s * block:(s + 1) * block], want)


def test_on_a_gpu_mesh_the_rows_go_in_one_ragged_all_to_all_each_way():
    """A mesh whose platform has the collective (GPU) sends the rows in one ``ragged_all_to_all``
    each way (the gradient: two more), the counts in one ``all_to_all``; explain counts each at
    its whole buffer (the most it can move), as the lowered program's collectives read. XLA:CPU
    cannot compile it: the program is lowered, not run."""
    x, index, ws = _inputs()
    mesh, layout = md.Mesh({"data": 8}, platform="gpu"), md.Layout({"batch": "data", "experts": "data"})
    n, tokens, held = 8, B * S // 8, E // 8
    rows, counts = (n - 1) / n * n * tokens * min(K, held) * D * 4, (n - 1) / n * n * held * 4
    for fn, trips in ((_ffn, 2), (_grads, 4)):
        report = md.explain(fn, mesh, layout, x, index, *ws, objective="bytes")
        want = {"all-to-all": (1, pytest.approx(counts)), "ragged-all-to-all": (trips, pytest.approx(trips * rows))}
        assert explain_summary(report) == want
        lowered = hlo_comm.analyze(md.lower(fn, mesh, layout, objective="bytes").lower(x, index, *ws).as_text("hlo"))
        assert {k: (v["count"], v["moved_bytes"]) for k, v in lowered.summary().items()} == want
    assert md.explain(_ffn, md.Mesh({"data": 8}), layout, x, index, *ws).summary().keys() == {"all-to-all"}


def test_a_ragged_exchange_under_a_stated_bound_drops_what_the_padded_one_drops():
    x, index, ws = _inputs(same_experts=True)
    mesh, layout = md.Mesh({"data": 8}), md.Layout({"batch": "data", "experts": "data"})
    ragged = md.lower(_exchanged("ragged", 1.0), mesh, layout, objective="bytes")(x, index, *ws)
    padded = md.lower(_exchanged("padded", 1.0), mesh, layout, objective="bytes")(x, index, *ws)
    assert float(ragged[1].array) == float(padded[1].array) == pytest.approx(12 / 16)
    np.testing.assert_array_equal(np.asarray(ragged[0].array), np.asarray(padded[0].array))
