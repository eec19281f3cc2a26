"""meshdsl.layers: T5 / Switch layers over named dims.

Each layer program runs once on global arrays (the reference, jitted) and once lowered under six
layouts on 8 devices (data, Megatron, 2-D weights, ZeRO-3 storage, expert parallel, and a mixed 3-D
layout); its outputs and ``jax.grad`` with respect to every parameter and the float input (taken
inside the lowered function) must agree. The loss is a sum of the outputs times fixed probes built
from ``md.arange``, so it is layout-invariant too. The math is checked against direct numpy ports of
Hugging Face's T5 / SwitchTransformers code; MoE communication against the compiled HLO and
``md.explain``. Shapes are small: the file is dominated by ~45 XLA compilations (about 75 s on two
CPU cores).
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.layers as L
from helpers import assert_same, bytes_by_kind, explain_summary, hlo_summary, to_numpy

B, S, D, F, H, K, V, E = 8, 8, 16, 32, 4, 4, 32, 8
D_MODEL, D_FF, HEADS, D_KV = md.Dim("d_model", D), md.Dim("d_ff", F), md.Dim("heads", H), md.Dim("d_kv", K)
VOCAB, EXPERTS = md.Dim("vocab", V), md.Dim("experts", E)
MESH_2D = {"data": 2, "model": 4}

LAYOUTS = {
    "data": (MESH_2D, {"batch": "data"}, None),
    "megatron": (MESH_2D, {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}, None),
    "2d": (MESH_2D, {"d_model": "data", "d_ff": "model", "heads": "model"}, None),
    "zero3": (MESH_2D, {"batch": "data"}, {"d_model": "data"}),
    "expert": ({"data": 8}, {"batch": "data", "group": "data", "experts": "data"}, None),
    "mixed": ({"data": 2, "model": 2, "fsdp": 2},
              {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model", "experts": "data",
               "group": "data"}, {"d_model": "fsdp"}),
}


def layout_case(name):
    mesh, rules, params = LAYOUTS[name]
    return md.Mesh(mesh), md.Layout(rules, params=params)


def named_leaves(tree):
    return [x for x in jax.tree_util.tree_leaves(tree, is_leaf=lambda v: isinstance(v, md.NamedArray))
            if isinstance(x, md.NamedArray)]


def probe(dims, salt: int) -> md.NamedArray:
    """A fixed, layout-invariant, irregular tensor over ``dims``: sin of a weighted sum of positions
    (cheaper to compile than random numbers, which matters at ~40 compiles per file)."""
    phase = 0.1 * salt
    for j, d in enumerate(dims):
        phase = phase + md.arange(d).astype(jnp.float32) * (0.7 + 0.31 * j + 0.13 * salt)
    return md.sin(phase)


def probe_loss(outputs):
    """sum_i <out_i, probe_i>: a scalar NamedArray whose gradient reaches every output element."""
    total = 0.0
    for i, y in enumerate(named_leaves(outputs)):
        if jnp.issubdtype(y.dtype, jnp.floating):
            total = total + md.sum(y.astype(jnp.float32) * probe(y.dims, i))
    return total


def with_grads(program):
    """``run(modules, x, extras) -> (outputs, (param grads, input grad))``, grads taken inside."""
    def run(modules, x, extras):
        graphdef, state = nnx.split(modules)

        def loss(state, x):
            out = program(nnx.merge(graphdef, state), x, extras)
            return probe_loss(out).array, out

        (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)
        return out, grads
    return run


def check_invariance(program, modules, x, extras, rtol=2e-4, atol=2e-4, layouts=tuple(LAYOUTS)):
    run = with_grads(program)
    expected = jax.jit(run)(modules, x, extras)
    for name in layouts:
        mesh, layout = layout_case(name)
        try:
            got = md.lower(run, mesh, layout)(modules, x, extras)
            assert_same(got, expected, rtol=rtol, atol=atol)
        except Exception as e:  # name the layout that failed
            raise AssertionError(f"layout {name!r}: {e}") from e
    return expected


@pytest.fixture(scope="module")
def x():
    return md.random.normal(jax.random.key(1), [md.Dim("batch", B), md.Dim("seq", S), D_MODEL])


@pytest.fixture(scope="module")
def ids():
    return md.named(jax.random.randint(jax.random.key(2), (B, S), 0, V), "batch seq")


@pytest.fixture(scope="module")
def key_mask():
    lengths = np.array([8, 5, 8, 3, 6, 8, 1, 7])
    return md.named(np.arange(S)[None, :] < lengths[:, None], "batch seq")


def arr(param_or_named, names):
    value = param_or_named.get_value() if hasattr(param_or_named, "get_value") else param_or_named
    return to_numpy(value, names.split()).astype(np.float64)


# -- layout invariance: forward and gradients --------------------------------------------------------


def test_dense_embedding_norm_dropout_are_layout_invariant(x, ids):
    rngs = nnx.Rngs(0)
    modules = (L.Embedding(VOCAB, D_MODEL, rngs=rngs), L.RMSNorm(D_MODEL), L.Dense(D_MODEL, D_FF, rngs=rngs),
               L.Dropout(0.25), L.Dense(D_FF, D_MODEL, rngs=rngs))

    def program(m, x, extras):
        emb, norm, up, drop, down = m
        ids, key = extras
        h = norm(x + emb(ids))
        h = down(drop(md.relu(up(h)), key))
        return h, emb.attend(h)

    check_invariance(program, modules, x, (ids, jax.random.key(3)))


def test_attention_is_layout_invariant(x, key_mask):
    rngs = nnx.Rngs(1)
    enc = md.random.normal(jax.random.key(4), [md.Dim("batch", B), md.Dim("seq", 16), D_MODEL])
    enc_mask = md.named(np.arange(16)[None, :] < np.array([16, 9, 3, 16, 12, 1, 16, 5])[:, None], "batch seq")
    modules = (L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, causal=True),
               L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, relative_bias=False))

    def program(m, x, extras):
        self_attn, cross = m
        key_mask, enc, enc_mask = extras
        y, bias = self_attn(x, key_mask=key_mask)
        z, none = cross(y, enc, key_mask=enc_mask)
        assert none is None
        return y, bias, z

    check_invariance(program, modules, x, (key_mask, enc, enc_mask))


def test_feedforward_is_layout_invariant(x):
    rngs = nnx.Rngs(2)
    modules = (L.FeedForward(D_MODEL, D_FF, rngs=rngs, activation="gated-gelu", dropout_rate=0.1),
               L.FeedForward(D_MODEL, D_FF, rngs=rngs, activation="relu"))

    def program(m, x, key):
        gated, plain = m
        return gated(x, key=key), plain(x)

    check_invariance(program, modules, x, jax.random.key(6))


@pytest.mark.parametrize("top_k, train", [pytest.param(1, True, marks=pytest.mark.slow), (2, False)])  # (1, True): ~27 s
def test_moe_is_layout_invariant(x, top_k, train):
    """Training capacity (factor 1.0: tokens are dropped) and evaluation capacity; jitter noise is
    random, and checked with the other random layers below."""
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(3), top_k=top_k, capacity_factor=1.0, min_capacity=1,
                router_scale=2.0)

    def program(m, x, extras):
        return m(x, train=train)

    out, _ = check_invariance(program, moe, x, None)
    assert float(out[1]["dropped_fraction"].array) > 0  # capacity is tight enough to drop tokens


def stacked_block(n_layers, rngs):
    stack = md.Dim("layers", n_layers)
    return (L.RelativePositionBias(HEADS, rngs=rngs, scale=D ** -0.5),
            (L.RMSNorm(D_MODEL, stack=stack),
             L.Attention(D_MODEL, HEADS, D_KV, rngs=rngs, relative_bias=False, stack=stack),
             L.RMSNorm(D_MODEL, stack=stack),
             L.FeedForward(D_MODEL, D_FF, rngs=rngs, dropout_rate=0.1, stack=stack)))


def block_step(bias):
    """One pre-norm T5 encoder block; the position bias is computed once, outside the scan."""
    def step(layer, x, key):
        norm1, attn, norm2, ff = layer
        k1, k2 = (None, None) if key is None else jax.random.split(key)
        y, _ = attn(norm1(x), bias=bias, key=k1)
        x = x + y
        x = x + ff(norm2(x), key=k2)
        return x, md.mean(md.square(x))
    return step


def encoder(remat="none"):
    def program(m, x, key):
        position, layers = m
        bias = position(x.dims["seq"], md.Dim("kv_seq", x.dims["seq"].size))
        return L.scan_layers(layers, x, block_step(bias), key=key, remat=remat)
    return program


@pytest.mark.slow   # ~35 s; test_models' T5 and MoE-T5 invariance scan their stacks under every layout by default
def test_scanned_stack_is_layout_invariant(x):
    """The layers inside md.scan (their own six layouts are tested above), with per-layer dropout
    keys and remat: ZeRO-3 storage gathered per step, and the mixed 3-D layout (tensor parallel
    heads and d_ff, storage split over a third axis)."""
    check_invariance(encoder("dots"), stacked_block(2, nnx.Rngs(4)), x, jax.random.key(8),
                     layouts=("zero3", "mixed"))


def test_initialisation_inside_lower_is_layout_invariant():
    """A stacked layer built inside md.lower: each device draws only its block, the values are the
    ones drawn on one device, and the parameters come back in the storage layout."""
    def init(key):
        return nnx.split(L.FeedForward(D_MODEL, D_FF, rngs=nnx.Rngs(params=key), stack=md.Dim("layers", 2)))[1]

    key = jax.random.key(14)
    expected = init(key)
    for name in ("zero3", "mixed"):
        mesh, layout = layout_case(name)
        got = md.lower(init, mesh, layout)(key)
        assert_same(got, expected, rtol=0, atol=0)
        kernel = got["wi_0"]["kernel"].get_value()
        want = jax.sharding.NamedSharding(mesh.jax_mesh, layout.spec(kernel.dims, mesh, storage=True))
        assert kernel.array.sharding.is_equivalent_to(want, kernel.ndim)


# -- stacks: scan == unrolled loop; remat; compile size --------------------------------------------------


def test_scan_equals_unrolled_python_loop_and_remat_policies(x):
    modules = stacked_block(2, nnx.Rngs(5))
    key = jax.random.key(9)

    def unrolled(m, x, key):
        position, layers = m
        bias = position(x.dims["seq"], md.Dim("kv_seq", S))
        ys = []
        for i in range(2):
            x, y = block_step(bias)(L.layer_at(layers, i), x, jax.random.fold_in(key, i))
            ys.append(md.reshape(y, "layers:1"))
        return x, md.concat(ys, "layers")

    expected = jax.jit(with_grads(unrolled))(modules, x, key)
    policies = list(L.REMAT_POLICIES)
    scanned = jax.jit(lambda *args: [with_grads(encoder(p))(*args) for p in policies])(modules, x, key)
    for ((carry, ys), grads) in scanned:
        assert ys.names == ("layers",)
        assert_same((carry, ys), expected[0], rtol=1e-5, atol=1e-5)
        assert_same(grads, expected[1], rtol=1e-4, atol=1e-5)


def test_remat_policies_by_name_choose_what_is_communicated_again(x):
    """Under Megatron, recomputing a layer (full) runs its forward all-reduces again in the backward
    pass; keeping what collectives produced (by name: "collectives" or "all-reduce") does not, and
    costs no more bytes than keeping everything. The results stay the unsharded ones."""
    modules = stacked_block(2, nnx.Rngs(5))
    key = jax.random.key(9)
    mesh, layout = layout_case("megatron")

    def all_reduce_bytes(policy):
        report = md.explain(with_grads(encoder(policy)), mesh, layout, modules, x, key)
        return sum(r.total_bytes for r in report.collectives if r.kind == "all-reduce")

    kept = all_reduce_bytes("none")
    assert all_reduce_bytes("full") > kept
    assert all_reduce_bytes("collectives") == kept
    assert all_reduce_bytes("all-reduce") == kept
    assert_same(md.lower(with_grads(encoder("collectives")), mesh, layout)(modules, x, key),
                jax.jit(with_grads(encoder("none")))(modules, x, key), rtol=1e-4, atol=1e-5)
    with pytest.raises(md.MeshDSLError, match="value names to keep from"):
        L.remat_policy("einsum,all-gathr")


def test_scan_program_size_does_not_grow_with_depth(x):
    sizes = []
    for n in (2, 5):
        modules = jax.eval_shape(lambda: stacked_block(n, nnx.Rngs(6)))
        jaxpr = jax.make_jaxpr(lambda m, x: with_grads(encoder("full"))(m, x, None))(modules, x)
        sizes.append(len(jaxpr.jaxpr.eqns))
    assert sizes[0] == sizes[1]


def test_scan_layers_needs_the_stack_dim(x):
    with pytest.raises(md.ShapeError, match="stack dim 'layers'"):
        L.scan_layers(L.RMSNorm(D_MODEL), x, lambda layer, c, k: (layer(c), None))
    with pytest.raises(md.MeshDSLError, match="remat policy"):
        L.with_remat(lambda: None, "sometimes")


# -- the math, against numpy ports of Hugging Face ------------------------------------------------------


def test_dense_and_embedding_math(x, ids):
    rngs = nnx.Rngs(13)
    out_proj = L.Dense([HEADS, D_KV], D_MODEL, rngs=rngs)              # contracts two dims at once
    stacked = L.Dense(D_MODEL, D_FF, rngs=rngs, stack=md.Dim("layers", 3))
    emb = L.Embedding(VOCAB, D_MODEL, rngs=rngs)
    h = md.reshape(x, "batch seq heads:4 d_kv:4")

    @jax.jit
    def run(modules, x, h, ids):
        out_proj, stacked, emb = modules
        return out_proj(h), stacked(x), emb(ids), emb.attend(x)

    y, per_layer, rows, logits = run((out_proj, stacked, emb), x, h, ids)
    xs, table = to_numpy(x).astype(np.float64), arr(emb.embedding, "vocab d_model")
    np.testing.assert_allclose(to_numpy(y, ["batch", "seq", "d_model"]),
                               xs @ arr(out_proj.kernel, "heads d_kv d_model").reshape(D, D), rtol=1e-4, atol=1e-5)
    assert out_proj.kernel.get_value().is_param and np.std(arr(out_proj.kernel, "heads d_kv d_model")) < 0.5
    assert per_layer.names == ("batch", "seq", "layers", "d_ff")    # a stack applied outside md.scan
    np.testing.assert_allclose(to_numpy(per_layer, ["layers", "batch", "seq", "d_ff"]),
                               np.einsum("bsd,ldf->lbsf", xs, arr(stacked.kernel, "layers d_model d_ff")),
                               rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(to_numpy(rows, ["batch", "seq", "d_model"]), table[to_numpy(ids)], rtol=1e-6)
    np.testing.assert_allclose(to_numpy(logits, ["batch", "seq", "vocab"]), xs @ table.T, rtol=1e-4, atol=1e-4)
    with pytest.raises(md.ShapeError, match="lacks"):
        out_proj(x)
    with pytest.raises(md.MeshDSLError, match="unknown activation"):
        L.FeedForward(D_MODEL, D_FF, rngs=rngs, activation="gated-tanh")
    with pytest.raises(md.MeshDSLError, match="dropout rate"):
        L.dropout(x, 1.0, jax.random.key(0))


def hf_relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    """transformers' T5Attention._relative_position_bucket, line by line in numpy (float32 log)."""
    relative_buckets = np.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).astype(np.int64) * num_buckets
        relative_position = np.abs(relative_position)
    else:
        relative_position = -np.minimum(relative_position, np.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    with np.errstate(divide="ignore", invalid="ignore"):
        large = max_exact + (np.log(relative_position.astype(np.float32) / np.float32(max_exact))
                             / np.float32(math.log(max_distance / max_exact))
                             * np.float32(num_buckets - max_exact)).astype(np.int64)
    large = np.minimum(large, np.full_like(large, num_buckets - 1))
    return relative_buckets + np.where(is_small, relative_position, large)


@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets, max_distance", [(32, 128), (16, 64), (8, 20), (64, 256)])
def test_relative_position_bucket_matches_hf(bidirectional, num_buckets, max_distance):
    rel = np.arange(-400, 401)
    got = L.relative_position_bucket(md.named(rel.astype(np.int32), "kv_seq"), bidirectional, num_buckets,
                                     max_distance)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got.array), hf_relative_position_bucket(rel, bidirectional,
                                                                                     num_buckets, max_distance))


def test_relative_position_bias_is_the_table_at_the_bucket():
    bias_layer = L.RelativePositionBias(HEADS, rngs=nnx.Rngs(0), bidirectional=False)
    bias = bias_layer(md.Dim("seq", 12), md.Dim("kv_seq", 20))
    assert bias.names == ("heads", "seq", "kv_seq")
    rel = np.arange(20)[None, :] - np.arange(12)[:, None]
    table = arr(bias_layer.embedding, "buckets heads")
    expected = table[hf_relative_position_bucket(rel, False)].transpose(2, 0, 1)
    np.testing.assert_allclose(to_numpy(bias), expected, rtol=1e-6)


def softmax(z, axis=-1):
    z = z - z.max(axis, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis, keepdims=True)


def test_attention_matches_t5_math(x, key_mask):
    attn = L.Attention(D_MODEL, HEADS, D_KV, rngs=nnx.Rngs(7), causal=True)
    y, bias = attn(x, key_mask=key_mask)
    xs = to_numpy(x).astype(np.float64)
    q = np.einsum("bsd,dhk->bhsk", xs, arr(attn.q.kernel, "d_model heads d_kv"))
    k = np.einsum("bsd,dhk->bhsk", xs, arr(attn.k.kernel, "d_model heads d_kv"))
    v = np.einsum("bsd,dhk->bhsk", xs, arr(attn.v.kernel, "d_model heads d_kv"))
    rel = np.arange(S)[None, :] - np.arange(S)[:, None]
    position_bias = arr(attn.relative_attention_bias.embedding, "buckets heads")[
        hf_relative_position_bucket(rel, bidirectional=False)].transpose(2, 0, 1)
    allowed = (rel <= 0)[None, None] & to_numpy(key_mask)[:, None, None, :]
    scores = q @ k.transpose(0, 1, 3, 2) + position_bias + np.where(allowed, 0.0, np.finfo(np.float32).min)
    out = np.einsum("bhst,bhtk->bshk", softmax(scores), v)
    expected = np.einsum("bshk,hkd->bsd", out, arr(attn.o.kernel, "heads d_kv d_model"))
    np.testing.assert_allclose(to_numpy(bias), position_bias, rtol=1e-6)
    np.testing.assert_allclose(to_numpy(y, ["batch", "seq", "d_model"]), expected, rtol=1e-4, atol=1e-5)


def gelu_new(z):
    return 0.5 * z * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (z + 0.044715 * z ** 3)))


@pytest.mark.parametrize("activation", ["gated-gelu", "relu", "gelu", "gated-silu"])
def test_feedforward_matches_t5_math(x, activation):
    ff = L.FeedForward(D_MODEL, D_FF, rngs=nnx.Rngs(8), activation=activation)
    xs = to_numpy(x).astype(np.float64)
    from scipy.special import erf  # noqa: PLC0415 - only this test needs scipy
    acts = {"gated-gelu": gelu_new, "relu": lambda z: np.maximum(z, 0),
            "gelu": lambda z: 0.5 * z * (1 + erf(z / math.sqrt(2))), "gated-silu": lambda z: z / (1 + np.exp(-z))}
    act = acts[activation]
    if activation.startswith("gated-"):
        h = act(xs @ arr(ff.wi_0.kernel, "d_model d_ff")) * (xs @ arr(ff.wi_1.kernel, "d_model d_ff"))
    else:
        h = act(xs @ arr(ff.wi.kernel, "d_model d_ff"))
    expected = h @ arr(ff.wo.kernel, "d_ff d_model")
    np.testing.assert_allclose(to_numpy(ff(x), ["batch", "seq", "d_model"]), expected, rtol=1e-4, atol=1e-5)


def test_rmsnorm_matches_t5_and_keeps_the_input_dtype():
    norm = L.RMSNorm(D_MODEL)
    norm.scale.set_value(md.param(md.random.uniform(jax.random.key(0), [D_MODEL], 0.5, 1.5)))
    scale = arr(norm.scale, "d_model")
    x32 = md.random.normal(jax.random.key(1), [md.Dim("batch", 4), D_MODEL]) * 3.0
    xs = to_numpy(x32).astype(np.float64)
    expected = xs / np.sqrt((xs ** 2).mean(-1, keepdims=True) + 1e-6) * scale
    y = norm(x32)
    assert y.dtype == jnp.float32
    np.testing.assert_allclose(to_numpy(y), expected, rtol=1e-5)
    y16 = norm(x32.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    np.testing.assert_allclose(to_numpy(y16).astype(np.float64), expected, rtol=2e-2, atol=2e-2)
    # the variance is float32: a float16 input whose square overflows float16 still normalises
    big = (x32 * 100.0).astype(jnp.float16)
    yb = norm(big)
    assert yb.dtype == jnp.float16 and np.isfinite(to_numpy(yb).astype(np.float32)).all()
    np.testing.assert_allclose(to_numpy(yb).astype(np.float64), expected, rtol=2e-2, atol=2e-2)
    assert L.RMSNorm(D_MODEL, dtype=jnp.float32)(big).dtype == jnp.float32


def test_dropout_masks_and_router_jitter_are_identical_across_layouts(x):
    key = jax.random.key(11)
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(12), jitter_noise=0.5, min_capacity=1)

    def program(moe, x, key):
        return (L.dropout(x, 0.3, key), L.Dropout(0.3)(x), L.dropout(x, 0.0, key), moe(x, key=key),
                moe(x, train=True))

    expected = jax.jit(program)(moe, x, key)
    dropped, same, also_same = (to_numpy(v) for v in expected[:3])
    jittered, plain = expected[3][0], expected[4][0]
    assert np.abs(to_numpy(jittered) - to_numpy(plain, jittered.names)).max() > 1e-3  # the jitter acts
    np.testing.assert_array_equal(same, to_numpy(x))
    np.testing.assert_array_equal(also_same, to_numpy(x))
    kept = dropped != 0
    assert 0.6 < kept.mean() < 0.8
    np.testing.assert_allclose(dropped[kept], to_numpy(x)[kept] / 0.7, rtol=1e-6)
    for name in ("expert", "mixed"):  # (dropout under all six layouts: the first test above)
        mesh, layout = layout_case(name)
        got = md.lower(program, mesh, layout)(moe, x, key)
        np.testing.assert_array_equal(to_numpy(got[0]), dropped)
        assert_same(got[3], expected[3], rtol=1e-5, atol=1e-5)


# -- MoE: routing math, token dropping, aux losses, communication -----------------------------------


def numpy_moe(moe, xs, top_k, capacity, dropped="zero"):
    """Switch / GShard routing written out token by token, with Hugging Face's top-1 semantics."""
    G, T, _ = xs.shape
    w = arr(moe.router.classifier.kernel, "d_model expert_choice")
    logits = xs @ w
    probs = softmax(logits)
    wi, wo = arr(moe.experts.wi.kernel, "experts d_model d_ff"), arr(moe.experts.wo.kernel, "experts d_ff d_model")
    y = np.zeros_like(xs)
    kept_count, load = 0, np.zeros(E)
    for g in range(G):
        order = np.argsort(-probs[g], axis=-1, kind="stable")[:, :top_k]   # [T, k]
        gates = np.take_along_axis(probs[g], order, -1)
        if top_k > 1:
            gates = gates / (gates.sum(-1, keepdims=True) + 1e-9)
        filled = np.zeros(E, int)
        for choice in range(top_k):          # every first choice in token order, then every second
            for t in range(T):
                e = order[t, choice]
                load[e] += 1
                filled[e] += 1
                if filled[e] <= capacity:
                    kept_count += 1
                    h = np.maximum(xs[g, t] @ wi[e], 0) @ wo[e]
                    y[g, t] += gates[t, choice] * h
                elif dropped == "hf":
                    y[g, t] += gates[t, choice] * xs[g, t]
    first = np.eye(E)[probs.argmax(-1)]
    lb = np.mean(first.mean(1) * probs.mean(1)) * E ** 2
    z = np.mean(np.log(np.exp(logits).sum(-1)) ** 2)
    return y, {"load_balancing_loss": lb, "router_z_loss": z, "dropped_fraction": 1 - kept_count / (G * T * top_k),
               "expert_load": load / (G * T * top_k)}


@pytest.mark.parametrize("top_k, capacity, dropped", [(1, 2, "zero"), (1, 3, "hf"), (2, 3, "zero"), (2, 8, "zero")])
def test_moe_matches_numpy_routing_and_aux_losses(x, top_k, capacity, dropped):
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(9), top_k=top_k, expert_capacity=capacity, dropped=dropped,
                router_scale=1.0)
    y, metrics = moe(x)
    xs = to_numpy(x).astype(np.float64)            # group = batch row, group_size = seq (HF's grouping)
    expected, aux = numpy_moe(moe, xs, top_k, capacity, dropped)
    np.testing.assert_allclose(to_numpy(y, ["batch", "seq", "d_model"]), expected, rtol=1e-4, atol=1e-5)
    for name, value in aux.items():
        np.testing.assert_allclose(np.asarray(metrics[name].array, np.float64), value, rtol=1e-5, atol=1e-6)
    assert metrics["expert_load"].names == ("experts",)
    # per token (what a pipeline's microbatches return): the same output, metrics whose means are these
    y_tokens, per_token = moe(x, per_token=True)
    assert_same(y_tokens, y)
    assert per_token["router_z_loss"].names == ("batch", "seq")
    assert per_token["expert_load"].names == ("batch", "seq", "expert_choice")
    for name, value in aux.items():
        np.testing.assert_allclose(to_numpy(per_token[name]).mean((0, 1)), value, rtol=1e-5, atol=1e-6)


def test_moe_drops_tokens_past_capacity():
    """A router that sends every token to expert 0: only the first `capacity` tokens of each group
    get an output, the rest get zero (they pass through the residual)."""
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(10), capacity_factor=0.5, min_capacity=1, group_size=4)
    assert moe.capacity(4, train=True) == 1 and moe.capacity(4, train=False) == 1
    kernel = np.zeros((D, E), np.float32)
    kernel[0, 0] = 1000.0
    moe.router.classifier.kernel.set_value(md.param(md.named(kernel, "d_model expert_choice")))
    xs = np.abs(np.asarray(jax.random.normal(jax.random.key(3), (B, S, D), jnp.float32))) + 0.1
    x = md.named(xs, "batch seq d_model")
    y, metrics = moe(x, key=jax.random.key(0))
    got = to_numpy(y, ["batch", "seq", "d_model"]).reshape(B * S // 4, 4, D)
    assert np.abs(got[:, 0]).min() > 0 and (got[:, 1:] == 0).all()
    assert float(metrics["dropped_fraction"].array) == pytest.approx(0.75)
    np.testing.assert_allclose(to_numpy(metrics["expert_load"]), np.eye(E)[0])
    assert float(metrics["load_balancing_loss"].array) == pytest.approx(E, rel=1e-3)  # all on one expert


def test_moe_capacity_rule():
    assert L.expert_capacity(64, 8, 1, 1.25) == 10         # ceil(64 * 1.25 / 8)
    assert L.expert_capacity(64, 8, 2, 2.0) == 32
    assert L.expert_capacity(8, 8, 1, 1.0) == 4            # min_capacity
    assert L.expert_capacity(2, 8, 1, 1.0) == 2            # never more than the group
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(0))
    assert (moe.capacity(64, train=True), moe.capacity(64, train=False)) == (10, 16)
    with pytest.raises(md.MeshDSLError, match="dropped"):
        L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(0), top_k=2, dropped="hf")


def test_moe_expert_parallelism_is_one_all_to_all_each_way(x):
    """experts: data moves the dispatched tokens with one all-to-all and brings them back with one;
    nothing else in the forward pass. md.explain predicts the compiled HLO byte for byte."""
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(11), top_k=2, capacity_factor=1.0)
    mesh, layout = layout_case("expert")
    n = mesh.shape["data"]
    capacity = moe.capacity(S, train=False)
    groups_per_device = B * S // S // n
    local = groups_per_device * E * capacity * D * 4           # [group/n, expert_choice, capacity, d_model]
    a2a = (n - 1) / n * local

    def forward(m, x):
        return m(x)[0]

    hlo = hlo_summary(md.lower(forward, mesh, layout), moe, x)
    report = md.explain(forward, mesh, layout, moe, x)
    assert hlo == {"all-to-all": (2, pytest.approx(2 * a2a))}
    assert explain_summary(report) == {"all-to-all": (2, pytest.approx(2 * a2a))}
    assert {r.tensor.split(" move ")[-1] for r in report.collectives} == {
        "data group_all->experts", "data expert_choice->group"}

    def train_grads(m, x):  # gradients for the parameters and the input (a block below needs it)
        graphdef, state = nnx.split(m)
        return jax.grad(lambda s, x: probe_loss(md.square(nnx.merge(graphdef, s)(x)[0])).array,
                        argnums=(0, 1))(state, x)

    hlo = hlo_summary(md.lower(train_grads, mesh, layout), moe, x)
    report = md.explain(train_grads, mesh, layout, moe, x)
    router_grad = 2 * (n - 1) / n * D * E * 4                 # the replicated router's gradient, summed
    assert hlo == {"all-reduce": (1, pytest.approx(router_grad)), "all-to-all": (4, pytest.approx(4 * a2a))}
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    assert [r.kind for r in report.collectives if r.phase == "forward"] == ["all-to-all"] * 2


def test_stacked_moe_in_a_scan_is_two_all_to_alls_per_layer(x):
    moe = L.MoE(D_MODEL, D_FF, EXPERTS, rngs=nnx.Rngs(15), stack=md.Dim("layers", 3))

    def stack(m, x):
        def step(layer, x, key):
            y, metrics = layer(x)
            return x + y, metrics
        return L.scan_layers(m, x, step)

    mesh, layout = layout_case("expert")
    expected = jax.jit(stack)(moe, x)
    f = md.lower(stack, mesh, layout)
    assert_same(f(moe, x), expected, rtol=1e-4, atol=1e-5)
    assert expected[1]["expert_load"].names == ("layers", "experts")
    hlo, report = hlo_summary(f, moe, x), md.explain(stack, mesh, layout, moe, x)
    assert hlo["all-to-all"][0] == 6 and explain_summary(report)["all-to-all"] == hlo["all-to-all"]
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    small = [r for r in report.collectives if r.kind != "all-to-all"]
    assert all(r.bytes <= 3 * E * 4 for r in small)  # the rest: the stacked per-layer metrics only
