"""meshdsl.layers: the math of each layer, unsharded, against direct numpy ports of Hugging Face's
T5 / SwitchTransformers code: dense and embedding, the relative position buckets and bias,
attention, the feed-forward activations, RMSNorm (and the dtypes it keeps), and MoE routing (top-1
and top-2, tokens dropped past capacity, the aux losses, the capacity rule). Layout invariance,
stacks and MoE communication are in test_layers.py.
"""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.layers as L
from helpers import B, D, D_FF, D_KV, D_MODEL, E, EXPERTS, HEADS, S, VOCAB, assert_same, to_numpy


def arr(param_or_named, names):
    value = param_or_named.get_value() if hasattr(param_or_named, "get_value") else param_or_named
    return to_numpy(value, names.split()).astype(np.float64)


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


# -- MoE: routing math, token dropping, aux losses -------------------------------------------------


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

