"""Llama-style decoder (meshdsl.layers.rotary, .gqa, meshdsl.models.llama): rotary embeddings are
relative rotations; grouped-query attention equals plain named ops with repeated key/value heads;
the model's forward and gradients are the same under data, Megatron, ZeRO-3, sequence-parallel and
pipeline layouts; KV-cache decoding gives the tokens of recomputing the whole sequence, the same
under every inference layout, each program compiled once; configs and errors.

No torch here: Hugging Face parity is tests/test_llama_hf.py, the training CLI tests/test_llama_train.py.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.models
from helpers import assert_same, lm_batch, lm_step
from meshdsl.layers import GroupedQueryAttention, apply_rotary, rotary_angles
from meshdsl.models.configs import LlamaConfig, config_from_dict, get_config
from meshdsl.models.decoding.generation_lm import LMGenerator
from meshdsl.models.llama import Llama, count_params

VOCAB = 64
CONFIG = get_config("llama-tiny").replace(d_model=32, d_ff=64, heads=8, kv_heads=4, vocab=VOCAB, layers=2)
MESH = md.Mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


# -- rotary embeddings and grouped-query attention -------------------------------------------------


def test_rotary_is_a_rotation_that_depends_on_relative_positions():
    d_head = md.Dim("d_head", 16)
    r = np.random.RandomState(0)
    q, k = (md.named(r.normal(size=(3, 16)).astype(np.float32), "length d_head") for _ in range(2))

    def rotated(x, start):
        return apply_rotary(x, *rotary_angles(md.arange(md.Dim("length", 3)) + start, d_head, 100.0))

    np.testing.assert_allclose(np.linalg.norm(rotated(q, 7).array, axis=-1), np.linalg.norm(q.array, axis=-1),
                               rtol=1e-5)
    # q at position m and k at position n: the score depends on m - n only
    scores = [md.einsum(rotated(q, s), md.rename(rotated(k, s), {"length": "kv"}), out="length kv")
              for s in (0, 5, 40)]
    for s in scores[1:]:
        np.testing.assert_allclose(np.asarray(s.array), np.asarray(scores[0].array), atol=1e-4)
    with pytest.raises(md.ShapeError, match="must be even"):
        rotary_angles(md.arange(md.Dim("length", 3)), md.Dim("d_head", 5))


def reference_attention(layer, x, angles, key_mask):
    """Multi-head attention with each key/value head repeated ``groups`` times: plain named ops."""
    heads = md.Dim("heads", layer.kv_heads.size * layer.groups.size)
    q = md.reshape(apply_rotary(layer.q(x), *angles), ["batch", "length", heads, "d_head"])
    k = apply_rotary(layer.k(x), *angles) * md.ones([layer.groups])
    v = layer.v(x) * md.ones([layer.groups])
    k = md.rename(md.reshape(md.transpose(k, "batch length kv_heads groups d_head"), ["batch", "length", heads,
                                                                                     "d_head"]), {"length": "kv"})
    v = md.rename(md.reshape(md.transpose(v, "batch length kv_heads groups d_head"), ["batch", "length", heads,
                                                                                     "d_head"]), {"length": "kv"})
    logits = md.einsum(q, k, out="batch heads length kv") / np.sqrt(layer.d_head.size)
    n = x.dims["length"]
    allowed = md.logical_and(md.arange(md.Dim("kv", n.size)) <= md.arange(n), key_mask)
    weights = md.softmax(md.where(allowed, logits, -1e30), "kv")
    mixed = md.reshape(md.einsum(weights, v, out="batch length heads d_head"),
                       ["batch", "length", layer.kv_heads, layer.groups, "d_head"])
    return layer.o(mixed)


@pytest.mark.parametrize("kv_heads, groups", [(2, 3), (4, 1), (1, 4)])
def test_grouped_query_attention_equals_repeated_key_value_heads(kv_heads, groups):
    dims = [md.Dim("d_model", 24), md.Dim("kv_heads", kv_heads), md.Dim("groups", groups), md.Dim("d_head", 8)]
    layer = GroupedQueryAttention(*dims, rngs=nnx.Rngs(1))
    x = md.random.normal(jax.random.key(2), md.shape("batch:2 length:6 d_model:24"))
    angles = rotary_angles(md.arange(md.Dim("length", 6)), md.Dim("d_head", 8), 10000.0)
    key_mask = md.named(np.array([[True] * 6, [False, False, True, True, True, True]]), "batch kv")
    expected = reference_attention(layer, x, angles, key_mask)
    got = md.rename(layer(md.rename(x, {"length": "seq"}), md.rename(angles, {"length": "seq"}) if False else
                          tuple(md.rename(a, {"length": "seq"}) for a in angles),
                          mask=md.rename(key_mask, {"kv": "kv_seq"})), {"seq": "length"})
    assert got.names == ("batch", "length", "d_model")
    np.testing.assert_allclose(np.asarray(got.array)[0], np.asarray(expected.array)[0], atol=1e-5)
    np.testing.assert_allclose(np.asarray(got.array)[1, 2:], np.asarray(expected.array)[1, 2:], atol=1e-5)


# -- the model under layouts -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def batch():
    return lm_batch(VOCAB, length=16)


def step(model, batch):
    loss, metrics, grads = lm_step(model, batch)
    return loss, metrics["accuracy"], grads


MEGATRON = {"batch": "data", "kv_heads": "model", "d_ff": "model", "vocab": "model"}
LAYOUTS = {
    "data": ({"batch": "data"}, None),
    "Megatron": (MEGATRON, None),
    "ZeRO-3": ({"batch": "data"}, {"d_model": "data"}),
    "Megatron sequence parallel": ({**MEGATRON, "length": "model"}, None),
    "context parallel": ({"batch": "data", "length": "model", "seq": "model", "kv_seq": "model"}, None),
}


@pytest.fixture(scope="module")
def expected(model, batch):
    return jax.jit(step)(model, batch)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_forward_and_gradients_are_layout_invariant(model, batch, expected, name):
    rules, params = LAYOUTS[name]
    got = md.lower(step, MESH, md.Layout(rules, params=params))(model, batch)
    assert_same(got, expected, rtol=2e-4, atol=2e-5)


def test_pipeline_over_the_layer_stack(model, batch, expected):
    """``layers: pipe`` runs the stack as a pipeline (GPipe, and 1F1B with the loss as its head)."""
    layout = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": 2})
    mesh = md.Mesh({"pipe": 2, "data": 4})
    for schedule in ("gpipe", "1f1b"):
        got = md.lower(step, mesh, layout, schedule=schedule)(model, batch)
        assert_same(got, expected, rtol=2e-4, atol=2e-5)


def test_positions_and_token_dim_names(model):
    ids = np.random.RandomState(4).randint(0, VOCAB, (2, 7))
    logits = model(md.named(ids, "batch targets"))
    assert logits.names == ("batch", "targets", "vocab")
    shifted = model(md.named(ids, "batch length"), positions=md.arange(md.Dim("length", 7)) + 3)
    np.testing.assert_allclose(np.asarray(shifted.array), np.asarray(logits.array), atol=1e-5)   # relative
    spread = model(md.named(ids, "batch length"), positions=md.arange(md.Dim("length", 7)) * 2)
    assert not np.allclose(np.asarray(spread.array)[:, 1:], np.asarray(logits.array)[:, 1:], atol=1e-3)
    # the first token sees only itself: its logits do not depend on what follows (causal)
    other = ids.copy()
    other[:, 1:] = (other[:, 1:] + 1) % VOCAB
    again = model(md.named(other, "batch targets"))
    np.testing.assert_allclose(np.asarray(again.array)[:, 0], np.asarray(logits.array)[:, 0], atol=1e-6)


# -- decoding --------------------------------------------------------------------------------------


def greedy_by_recomputing(model, ids, new):
    """The whole sequence through the model again for every new token: no cache."""
    f = jax.jit(lambda m, i: md.argmax(m(i), "vocab"))
    out = np.asarray(ids)
    for _ in range(new):
        nxt = np.asarray(f(model, md.named(jnp.asarray(out), "batch length")).array)[:, -1:]
        out = np.concatenate([out, nxt], 1)
    return out


PROMPT = np.random.RandomState(5).randint(2, VOCAB, (4, 5))
NEW = 6
INFERENCE = {
    "batch-split": md.Layout({"batch": "data"}),
    "1d-weight-stationary": md.Layout({"batch": "data", "kv_heads": "model", "d_ff": "model", "vocab": "model"}),
    "kv-split": md.Layout({"batch": "data", "kv_length": "model"}),
    "weight-gathered": md.Layout({"batch": "data"}, params={"d_model": "model"}),
}


def test_kv_cache_decoding_equals_recomputing_and_every_layout(model):
    expected = greedy_by_recomputing(model, PROMPT, NEW)
    got = meshdsl.models.generate(model, PROMPT, max_new_tokens=NEW, eos_id=-1)
    np.testing.assert_array_equal(np.asarray(got.array), expected)
    for name, layout in INFERENCE.items():
        if name == "kv-split":        # a layout per phase: prefill batch-split, decode with a split cache
            layout = {"prefill": INFERENCE["batch-split"], "decode": layout}
        got = meshdsl.models.generate(model, PROMPT, max_new_tokens=NEW, eos_id=-1, mesh=MESH, layout=layout)
        np.testing.assert_array_equal(np.asarray(got.array), expected, err_msg=name)


def test_sampled_tokens_are_the_same_under_every_layout(model):
    kw = dict(max_new_tokens=NEW, method="sample", key=jax.random.key(7), temperature=0.8, top_k=20, top_p=0.9)
    expected = np.asarray(meshdsl.models.generate(model, PROMPT, **kw).array)
    assert expected.shape == (4, 5 + NEW)
    for name in ("1d-weight-stationary", "kv-split"):
        got = meshdsl.models.generate(model, PROMPT, mesh=MESH, layout=INFERENCE[name], **kw)
        np.testing.assert_array_equal(np.asarray(got.array), expected, err_msg=name)


def test_decode_step_compiles_once_and_eos_stops(model):
    g = LMGenerator(MESH, INFERENCE["batch-split"], INFERENCE["1d-weight-stationary"])
    meshdsl.models.generate(model, PROMPT, max_new_tokens=5, eos_id=-1, generator=g)
    first = dict(g.traces)   # each program traced once, or twice where its plan beats the rules' choices
    out = meshdsl.models.generate(model, PROMPT, max_new_tokens=5, eos_id=-1, generator=g)   # 5 + 4 more
    assert g.traces == first and set(first.values()) <= {1, 2} and out.dims["length"].size == 10
    first = np.asarray(out.array)[:, 5]          # make every row's first new token its eos
    stopped = meshdsl.models.generate(model, PROMPT[:1], max_new_tokens=5, eos_id=int(first[0]))
    assert np.asarray(stopped.array).shape == (1, 6)


def test_errors_say_what_to_change(model):
    with pytest.raises(md.MeshDSLError, match="'greedy' or 'sample'"):
        meshdsl.models.generate(model, PROMPT, max_new_tokens=2, method="beam")
    right_padded = np.ones(PROMPT.shape, bool)
    right_padded[0, -1] = False
    with pytest.raises(md.MeshDSLError, match="left-padded"):
        meshdsl.models.generate(model, PROMPT, max_new_tokens=2, attention_mask=right_padded)
    with pytest.raises(ValueError, match="do not divide into 3"):
        CONFIG.replace(kv_heads=3)
    with pytest.raises(md.ShapeError, match=r"\[batch, <length>\]"):
        model(md.named(np.zeros((2, 3, 4), np.int32), "batch length x"))


# -- configs -----------------------------------------------------------------------------------------


def test_configs_and_parameter_counts():
    c = get_config("llama-tiny")
    assert isinstance(c, LlamaConfig) and c.decoder_only and c.head_dim == 16 and c.groups == 2
    assert config_from_dict(dict(c.__dict__)) == c
    assert config_from_dict(dict(get_config("t5-tiny").__dict__)) == get_config("t5-tiny")
    for name in ("llama-2-7b", "llama-3-8b"):     # by formula (HF's own count: tests/test_llama_hf.py)
        c = get_config(name)
        attention = c.d_model * c.head_dim * (2 * c.heads + 2 * c.kv_heads)
        layer = attention + 3 * c.d_model * c.d_ff + 2 * c.d_model
        embeddings = c.vocab * c.d_model * (1 if c.tie_embeddings else 2)
        assert count_params(c) == c.layers * layer + embeddings + c.d_model
    assert count_params(get_config("llama-2-7b")) == 6_738_415_616
    assert count_params(get_config("llama-3-8b")) == 8_030_261_248
