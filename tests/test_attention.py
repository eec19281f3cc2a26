"""``md.attention``: blockwise attention equal to softmax attention, and context parallelism
(gather, ring, Ulysses) equal to the unsharded program under every layout, with the bytes
its formulas give and the compiled program moves."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import assert_same, explain_vs_hlo, moved_by_backend, promises_kept
from meshdsl.ops import balance, flash
from meshdsl.platform.jaxcompat import varying_axes
from meshdsl.layers.position import relative_position_bucket

B, L, H, D = 2, 24, 4, 8
MASK = float(jnp.finfo(jnp.float32).min)


def _arrays(seed=0, length=L, heads=H, kv_heads=None):
    r = np.random.RandomState(seed)

    def arr(names, *shape):
        return md.named(jnp.asarray(r.randn(*shape), jnp.float32), names)

    if kv_heads:   # grouped-query: q [.. kv_heads groups ..], k and v without groups
        q = arr("batch length kv_heads groups d_kv", B, length, kv_heads, heads // kv_heads, D)
        k = arr("batch kv_length kv_heads d_kv", B, length, kv_heads, D)
        v = arr("batch kv_length kv_heads d_kv", B, length, kv_heads, D)
    else:
        q = arr("batch length heads d_kv", B, length, heads, D)
        k = arr("batch kv_length heads d_kv", B, length, heads, D)
        v = arr("batch kv_length heads d_kv", B, length, heads, D)
    return q, k, v


def reference(q, k, v, *, causal=False, bias=None, mask=None, scale=None):
    """Softmax attention in named ops: the logits [.., length, kv_length] materialised."""
    feats = "d_kv"
    scale = D ** -0.5 if scale is None else scale
    stats = [n for n in q.names if n != feats]
    logits = md.einsum(q, k, out=[*stats, "kv_length"]) * scale
    if bias is not None:
        logits = logits + bias
    allowed = None
    if causal:
        allowed = md.arange(k.dims["kv_length"]) <= md.arange(q.dims["length"])
    if mask is not None:
        allowed = mask if allowed is None else allowed & mask
    if allowed is not None:
        logits = logits + md.where(allowed, 0.0, MASK)
    return md.einsum(md.softmax(logits, "kv_length"), v, out=q.names)


def _loss(attend, w):
    def loss(q, k, v):
        return md.sum(attend(q, k, v) * w).array
    return loss


def _grads(attend, w):
    return lambda q, k, v: jax.grad(_loss(attend, w), argnums=(0, 1, 2))(q, k, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("block", [None, 8, 5])   # one block; three blocks (an odd count); 5 -> 4 of 6
def test_blockwise_attention_equals_softmax_attention_forward_and_backward(causal, block):
    q, k, v = _arrays()
    w = _arrays(1)[0]
    got = md.attention(q, k, v, causal=causal, block=block)
    assert got.names == q.names
    assert_same(got, reference(q, k, v, causal=causal), 1e-5, 1e-5)
    assert_same(_grads(lambda *a: md.attention(*a, causal=causal, block=block), w)(q, k, v),
                _grads(lambda *a: reference(*a, causal=causal), w)(q, k, v), 1e-4, 1e-5)


def test_grouped_query_attention_is_broadcasting_of_the_groups_dim():
    q, k, v = _arrays(kv_heads=2)
    w = _arrays(1, kv_heads=2)[0]
    got = md.attention(q, k, v, length="length", causal=True, block=8)
    assert got.names == q.names
    assert_same(got, reference(q, k, v, causal=True), 1e-5, 1e-5)
    assert_same(_grads(lambda *a: md.attention(*a, length="length", causal=True, block=8), w)(q, k, v),
                _grads(lambda *a: reference(*a, causal=True), w)(q, k, v), 1e-4, 1e-5)


def test_bias_and_key_mask_match_adding_them_to_the_logits_and_the_bias_gets_its_gradient():
    q, k, v = _arrays()
    r = np.random.RandomState(3)
    bias = md.named(jnp.asarray(r.randn(H, L, L), jnp.float32), "heads length kv_length")
    mask = md.named(jnp.asarray(r.rand(B, L) > 0.3), "batch kv_length")
    got = md.attention(q, k, v, bias=bias, mask=mask, block=8)
    assert_same(got, reference(q, k, v, bias=bias, mask=mask), 1e-5, 1e-5)

    def dbias(attend):
        return jax.grad(lambda b: md.sum(attend(b) * q).array)(bias)
    assert_same(dbias(lambda b: md.attention(q, k, v, bias=b, mask=mask, block=8)),
                dbias(lambda b: reference(q, k, v, bias=b, mask=mask)), 1e-4, 1e-5)


@pytest.mark.parametrize("kv_heads", [None, 2])
@pytest.mark.parametrize("causal", [False, True])
def test_jax_dot_product_attention_computes_the_same_where_the_keys_are_whole(kv_heads, causal):
    """``implementation="xla"`` runs ``jax.nn.dot_product_attention`` (on a GPU, ``"cudnn"``: the
    same call, its fused kernel): the named dims mapped to its batch, heads and features."""
    q, k, v = _arrays(kv_heads=kv_heads)
    w = _arrays(1, kv_heads=kv_heads)[0]

    def attend(impl):
        return lambda *a: md.attention(*a, length="length", causal=causal, implementation=impl)
    assert_same(attend("xla")(q, k, v), attend("flash")(q, k, v), 1e-5, 1e-5)
    assert_same(_grads(attend("xla"), w)(q, k, v), _grads(attend("flash"), w)(q, k, v), 1e-4, 1e-5)
    strategy = "gather" if kv_heads else "ulysses"   # 2 kv heads do not divide over 4 devices
    assert_same(md.lower(attend("xla"), MESH, md.Layout(CP), attention=strategy)(q, k, v), attend("flash")(q, k, v),
                1e-5, 1e-5)


def test_jax_dot_product_attention_takes_bias_masks_and_permuted_positions():
    q, k, v = _arrays()
    r = np.random.RandomState(3)
    bias = md.named(jnp.asarray(r.randn(H, L, L), jnp.float32), "heads length kv_length")
    mask = md.named(jnp.asarray(r.rand(B, L) > 0.3), "batch kv_length")
    order = r.permutation(L)
    for kw in ({"bias": bias, "mask": mask, "causal": True}, {"causal": True, "q_positions": order, "kv_positions": order}):
        assert_same(md.attention(q, k, v, implementation="xla", **kw), md.attention(q, k, v, **kw), 1e-5, 1e-5)


def _relative(table, q_positions, kv_positions):
    """T5's causal relative position bias of the positions given: [heads, length, kv_length]."""
    bucket = relative_position_bucket(kv_positions - q_positions, bidirectional=False)
    return md.take(table, bucket, "buckets")


@pytest.mark.parametrize("causal", [False, True])
def test_a_bias_computed_on_each_block_from_its_positions_equals_the_whole_bias(causal):
    """``bias=(fn, table)``: T5's relative position bias made tile by tile from global positions
    (no [length, kv_length] bias held) equals adding the whole bias, values and the table's
    gradient, unsharded and under each context-parallel strategy."""
    q, k, v = _arrays()
    table = md.param(md.named(jnp.asarray(np.random.RandomState(5).randn(32, H), jnp.float32), "buckets heads"))

    def whole(t):
        return _relative(t, md.arange(md.Dim("length", L)), md.arange(md.Dim("kv_length", L)))

    def loss(bias_of):
        return lambda q, k, v, t: md.sum(md.attention(q, k, v, causal=causal, bias=bias_of(t), block=2) * q).array

    def grads(bias_of):
        return lambda q, k, v, t: jax.grad(loss(bias_of), argnums=(0, 3))(q, k, v, t)
    blockwise = grads(lambda t: (_relative, t))
    assert_same(blockwise(q, k, v, table), grads(whole)(q, k, v, table), 1e-4, 1e-5)
    for strategy in ("gather", "ring", "ulysses"):
        assert_same(md.lower(blockwise, MESH, md.Layout(CP), attention=strategy)(q, k, v, table),
                    blockwise(q, k, v, table), 1e-4, 1e-5)


def test_the_ring_keeps_less_memory_than_gathering_the_keys():
    """Compiled: the ring holds one chunk of keys and values (a scan over the steps), gathering
    holds them all for the backward pass."""
    q, k, v = _arrays(length=1024, heads=4)
    w = _arrays(1, length=1024, heads=4)[0]
    attend = lambda *a: md.attention(*a, causal=True)   # noqa: E731
    temps = {s: md.explain(_grads(attend, w), MESH, md.Layout(CP), q, k, v, attention=s).compiled_memory()["temporaries"]
             for s in ("gather", "ring")}
    assert temps["ring"] < temps["gather"], temps


def test_memory_grows_linearly_with_the_length_not_with_its_square():
    """Doubling the length doubles the temporaries at most (the logits would quadruple: 32 MiB at
    2048 positions); each holds one block of logits."""
    def temporaries(n):
        q, k, v = _arrays(length=n, heads=2)
        return md.explain(lambda q, k, v: md.attention(q, k, v, causal=True, block=256),
                          md.Mesh({"data": 2, "ctx": 4}), md.Layout({"batch": "data"}), q, k, v).memory["temporaries"]
    small, large = temporaries(1024), temporaries(2048)
    assert large <= 2.05 * small, (small, large)
    assert large < B // 2 * 2 * 2048 * 2048 * 4 / 8


MESH = md.Mesh({"data": 2, "ctx": 4})
CP = {"batch": "data", "length": "ctx", "kv_length": "ctx"}


@pytest.mark.parametrize("strategy", ["gather", "ring", "ulysses"])
@pytest.mark.parametrize("causal", [False, True])
def test_each_context_parallel_strategy_equals_the_unsharded_attention(strategy, causal):
    q, k, v = _arrays()
    w = _arrays(1)[0]

    def attend(*a):
        return md.attention(*a, causal=causal, block=2)   # three blocks of queries and of keys per device
    layout = md.Layout(CP)
    assert_same(md.lower(attend, MESH, layout, attention=strategy)(q, k, v), attend(q, k, v))
    assert_same(md.lower(_grads(attend, w), MESH, layout, attention=strategy)(q, k, v),
                _grads(attend, w)(q, k, v), 1e-4, 1e-5)


def _block(k):
    """Bytes of this device's chunk of ``k`` on MESH under CP (batch over 2, positions over 4)."""
    return k.size * 4 // 8


@pytest.mark.parametrize("strategy, forward, backward", [
    ("ring", {"collective-permute": 2 * 3}, {"collective-permute": 4 * 3}),
    ("gather", {"all-gather": 2 * 3}, {"reduce-scatter": 2 * 3}),
])
def test_ring_and_gather_move_their_formulas_bytes_and_explain_equals_the_compiled_program(strategy, forward, backward):
    """Ring: forward 2 (n-1) |K_loc|, backward 4 (n-1) |K_loc|; gather: (n-1) |K_loc| each way for
    keys and values. n = 4."""
    q, k, v = _arrays()
    w = _arrays(1)[0]
    attend = lambda *a: md.attention(*a, causal=True)   # noqa: E731
    chunk = _block(k)
    e, h = explain_vs_hlo(_grads(attend, w), MESH, md.Layout(CP), q, k, v, attention=strategy)
    expected = {kind: n * chunk for kind, n in {**forward, **backward}.items()}
    if strategy == "ring":
        expected = {"collective-permute": (6 + 12) * chunk}
    assert e == h == expected
    entry, = md.explain(_grads(attend, w), MESH, md.Layout(CP), q, k, v, attention=strategy).attention
    assert entry["strategy"] == strategy and entry["devices"] == 4 and entry["axes"] == ["ctx"]
    if strategy == "ring":
        assert entry["bytes_per_step"] == 2 * chunk
        assert (entry["forward_bytes"], entry["backward_bytes"]) == (2 * 3 * chunk, 4 * 3 * chunk)


def test_ulysses_is_one_all_to_all_per_tensor_each_way():
    q, k, v = _arrays()
    w = _arrays(1)[0]
    attend = lambda *a: md.attention(*a, causal=True)   # noqa: E731
    e, h = explain_vs_hlo(_grads(attend, w), MESH, md.Layout(CP), q, k, v, attention="ulysses")
    local = _block(q)
    # q, k and v each way; the result stays split by heads (the weights it meets are a constant:
    # sliced there, nothing moves)
    assert e == h == {"all-to-all": 6 * 3 / 4 * local}


def test_the_planner_chooses_ulysses_by_bytes_and_gather_when_no_head_dim_divides():
    """By bytes Ulysses' all-to-alls move least; by time at this size the gather's two collectives
    beat its four (their latencies); where no head dim divides, the gather either way."""
    attend = lambda *a: md.attention(*a, causal=True)   # noqa: E731
    q, k, v = _arrays()
    report = md.explain(attend, MESH, md.Layout(CP), q, k, v, objective="bytes")
    assert [a["strategy"] for a in report.attention] == ["ulysses"]
    assert any("attention" in d["op"] for d in report.decisions())
    assert [a["strategy"] for a in md.explain(attend, MESH, md.Layout(CP), q, k, v).attention] == ["gather"]
    q, k, v = _arrays(heads=3)   # 3 heads over 4 devices: no Ulysses
    report = md.explain(attend, MESH, md.Layout({**CP, "batch": ()}), q, k, v)
    assert [a["strategy"] for a in report.attention] == ["gather"]


def test_queries_and_keys_renamed_off_the_layout_stay_split_where_they_are():
    """A model that attends over renamed dims (``length`` -> ``seq`` and ``kv_seq``, as T5 and Llama
    do) is context-parallel under ``length: ctx`` alone: the queries are not gathered."""
    x = _arrays()[0]

    def attend(x):
        q, kv = md.rename(x, {"length": "seq"}), md.rename(x, {"length": "kv_seq"})
        return md.rename(md.attention(q, kv, kv, over="kv_seq", length="seq", causal=True), {"seq": "length"})
    layout = md.Layout({"batch": "data", "length": "ctx"})
    assert_same(md.lower(attend, MESH, layout)(x), attend(x))
    entry, = md.explain(attend, MESH, layout, x).attention
    assert entry["strategy"] in ("gather", "ulysses") and entry["devices"] == 4


def test_the_planner_never_moves_more_bytes_than_gspmd_on_context_parallel_attention():
    q, k, v = _arrays()
    w = _arrays(1)[0]
    moved = moved_by_backend(_grads(lambda *a: md.attention(*a, causal=True), w), MESH, md.Layout(CP), q, k, v)
    assert moved["explicit"] <= moved["gspmd"], moved


def test_split_features_reduce_the_logits_once_where_that_moves_fewer_bytes_than_gathering():
    """Short sequences of long features split over the mesh: one all-reduce of the logits'
    partial sums (the compiler's choice too), not an all-gather of q and k."""
    r = np.random.RandomState(0)
    x = md.named(jnp.asarray(r.randn(64, 8, 8), jnp.float32), "d_kv length batch")

    def attend(x):
        kv = md.rename(x, {"length": "kv_length"})
        return md.attention(x, kv, kv, length="length", features="d_kv", causal=True)
    mesh, layout = md.Mesh({"x": 8}), md.Layout({"d_kv": "x"})
    promises_kept(attend, mesh, layout, x, moved={"all-reduce": 2 * 7 / 8 * 8 * 8 * 8 * 4})


def test_keys_split_along_their_positions_and_whole_queries_combine_by_statistics():
    """A KV cache split along kv_length (decoding): each device attends to its keys; one pmax and
    two psums, never a gather of the keys."""
    q, k, v = _arrays()
    attend = lambda *a: md.attention(*a, causal=True)   # noqa: E731
    layout = md.Layout({"batch": "data", "kv_length": "ctx"})
    assert_same(md.lower(attend, MESH, layout)(q, k, v), attend(q, k, v))
    w = _arrays(1)[0]
    assert_same(md.lower(_grads(attend, w), MESH, layout)(q, k, v), _grads(attend, w)(q, k, v), 1e-4, 1e-5)
    report = md.explain(attend, MESH, layout, q, k, v)
    assert report.attention[0]["strategy"] == "partial"
    assert set(report.counts()) == {"all-reduce"}


def test_zigzag_order_balances_causal_work_and_attends_over_its_positions():
    q, k, v = _arrays(length=32)
    order = balance.zigzag_positions(32, 4)
    assert sorted(order) == list(range(32))

    def attend(*a):
        return md.attention(*a, causal=True, q_positions=order, kv_positions=order, block=4)

    def permuted(x, dim):
        return md.named(jnp.take(x.array, jnp.asarray(order), axis=x.names.index(dim)), x.names)
    contiguous = md.attention(q, k, v, causal=True)
    qz, kz, vz = permuted(q, "length"), permuted(k, "kv_length"), permuted(v, "kv_length")
    got = md.lower(attend, MESH, md.Layout(CP), attention="ring")(qz, kz, vz)
    assert_same(got, permuted(contiguous, "length"), 1e-5, 1e-5)
    zig = md.explain(attend, MESH, md.Layout(CP), qz, kz, vz, attention="ring").attention[0]["balance"]
    plain = md.explain(lambda *a: md.attention(*a, causal=True, block=4), MESH, md.Layout(CP), q, k, v,
                       attention="ring").attention[0]["balance"]
    assert zig == 1.0 and plain == pytest.approx(15 / 9)   # device 3 computes 15 tiles, the mean is 9


def test_explain_shows_the_attention_strategy_table():
    q, k, v = _arrays()
    text = md.explain(lambda *a: md.attention(*a), MESH, md.Layout(CP), q, k, v, attention="ring").to_markdown()
    assert "| attention | strategy |" in text and "| ring | ctx | 4 |" in text


def test_search_takes_the_ring_where_a_tight_budget_rejects_gathering_the_keys():
    """Two heads over four devices: no Ulysses; the planner gathers the keys (fewest bytes); under a
    budget below that peak the search keeps the split and the solve itself rotates them (nothing
    forced)."""
    x = md.named(jax.ShapeDtypeStruct((2, 4096, 2, 64), jnp.float32), "batch length heads d_kv")

    def attend(x):
        kv = md.rename(x, {"length": "kv_length"})
        return md.attention(x, kv, kv, causal=True)
    mesh = md.Mesh.abstract({"ctx": 4})
    split = md.Layout({"length": "ctx"})
    peaks = {s: md.explain(attend, mesh, split, x, attention=s).memory["peak"] for s in ("gather", "ring")}
    assert peaks["ring"] < peaks["gather"]
    loose = md.search(attend, mesh, x, dims=["length"])
    assert loose.best.layout.rules == split.rules and "attention" not in loose.best.lower_kwargs
    tight = md.search(attend, mesh, x, dims=["length"], memory_budget=(peaks["ring"] + peaks["gather"]) / 2,
                      memory_margin=0.0)
    assert tight.best.layout.rules == split.rules and "attention" not in tight.best.lower_kwargs
    assert [a["strategy"] for a in tight.best.report.attention] == ["ring"]


# -- context parallelism composed with the other strategies -----------------------------------------

D_MODEL, LAYERS = 16, 2


def _model_args(seed=0):
    r = np.random.RandomState(seed)

    def p(names, *shape):
        return md.param(md.named(jnp.asarray(r.randn(*shape) * 0.3, jnp.float32), names))
    x = md.named(jnp.asarray(r.randn(4, L, D_MODEL), jnp.float32), "batch length d_model")
    weights = {n: p(f"layers d_model heads d_kv", LAYERS, D_MODEL, H, D) for n in ("q", "k", "v")}
    weights["o"] = p("layers heads d_kv d_model", LAYERS, H, D, D_MODEL)
    return x, weights


def _model(causal):
    def layer(x, w):
        q = md.einsum(x, w["q"], out="batch length heads d_kv")
        kv_in = md.rename(x, {"length": "kv_length"})
        k = md.einsum(kv_in, w["k"], out="batch kv_length heads d_kv")
        v = md.einsum(kv_in, w["v"], out="batch kv_length heads d_kv")
        y = md.attention(q, k, v, causal=causal)
        return x + md.einsum(y, w["o"], out=x.names), None

    def loss(x, weights):
        h, _ = md.scan(layer, x, weights, dim="layers")
        return md.mean(md.square(h)).array

    return lambda x, weights: jax.grad(loss, argnums=(0, 1))(x, weights)


COMPOSED = {
    "context x data": ({"data": 2, "ctx": 4}, md.Layout({"batch": "data", "length": "ctx"})),
    "context x Megatron heads": ({"model": 2, "ctx": 4}, md.Layout({"heads": "model", "length": "ctx"})),
    "context x pipeline": ({"pipe": 2, "ctx": 4}, md.Layout({"layers": "pipe", "length": "ctx"},
                                                             microbatches={"batch": 2})),
    "context x ZeRO-3": ({"data": 2, "ctx": 4}, md.Layout({"batch": "data", "length": "ctx"},
                                                          params={"d_model": "data"})),
}


@pytest.mark.parametrize("name", sorted(COMPOSED))
@pytest.mark.parametrize("strategy, causal", [(None, True), ("ring", True), ("ring", False)])
def test_context_parallelism_composes_with_data_megatron_pipeline_and_zero3(name, strategy, causal):
    mesh, layout = COMPOSED[name]
    args = _model_args()
    fn = _model(causal=causal)
    assert_same(md.lower(fn, md.Mesh(mesh), layout, attention=strategy)(*args), fn(*args), 1e-4, 1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_a_priced_candidate_stands_in_for_attention_with_its_results_shapes_and_types(with_bias):
    """The planner prices a candidate without computing the blockwise attention: what stands in
    for it has the shapes, dtypes and mesh axes each result varies over of what it computes (the
    queries, the keys and the values each typed varying over another axis)."""
    spec = flash.Spec(("b", "t", "f"), ("b", "s", "f"), ("b", "s", "g"), ("b", "t", "g"), "t", "s", ("f",),
                      0.5, True, ("b", "t", "s") if with_bias else None)
    mesh = jax.make_mesh((2, 2, 2), ("x", "y", "z"), axis_types=(jax.sharding.AxisType.Explicit,) * 3)
    seen = []

    def both(q, k, v, bias):
        q, k, v = (jax.lax.pcast(a, axis, to="varying") for a, axis in ((q, "x"), (k, "y"), (v, "z")))
        chunk = flash.Chunk(k, v, bias if with_bias else None, None, jnp.arange(6))
        for out in (flash.attend(spec, q, chunk, jnp.arange(4), 2, 2), flash.attend_types(spec, q, chunk, jnp.arange(4))):
            seen.append([(a.shape, a.dtype, varying_axes(a)) for a in out])
        return q

    P = jax.sharding.PartitionSpec
    jax.make_jaxpr(jax.shard_map(both, mesh=mesh, in_specs=P(), out_specs=P("x"), check_vma=True))(
        *(jnp.zeros(s) for s in ((3, 4, 5), (3, 6, 5), (3, 6, 7), (3, 4, 6))))
    real, priced = seen
    assert real == priced
    assert real[0][2] == real[1][2] == {"x", "y", "z"}
