"""Mixtral- and Qwen2-MoE-style decoders (meshdsl.models.llama with ``experts``): the loss adds the
router's load-balancing loss times its coefficient and reports the router's metrics; the loss and
gradients of mixtral-tiny are the unsharded ones under data parallelism, expert parallelism and
expert parallelism with Megatron inside the experts, and under a 1F1B pipeline; KV-cache decoding
gives the tokens of recomputing the whole sequence; configs count their parameters and refuse
impossible ones by name.

No torch here: Hugging Face parity is tests/test_moe_decoder_hf.py.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.models
from helpers import assert_same, lm_batch, lm_step
from meshdsl.models.configs import LlamaConfig, config_from_dict, get_config
from meshdsl.models.llama import Llama, count_params

VOCAB = 64
CONFIG = get_config("mixtral-tiny").replace(d_model=32, d_ff=48, vocab=VOCAB)
MESH = md.Mesh({"data": 4, "model": 2})


@pytest.fixture(scope="module")
def model():
    return Llama(CONFIG, rngs=nnx.Rngs(0))


@pytest.fixture(scope="module")
def batch():
    return lm_batch(VOCAB, length=12)


def step(model, batch):
    loss, metrics, grads = lm_step(model, batch)
    return loss, {k: v for k, v in metrics.items() if k.startswith("moe/")}, grads


STEP = jax.jit(step)


@pytest.fixture(scope="module")
def expected(model, batch):
    return STEP(model, batch)


def test_the_loss_adds_the_balancing_loss_times_its_coefficient(model, batch, expected):
    loss, moe, grads = expected
    assert set(moe) == {"moe/load_balancing_loss", "moe/router_z_loss", "moe/expert_load", "moe/dropped_fraction"}
    assert moe["moe/expert_load"].names == ("experts",)
    np.testing.assert_allclose(float(md.sum(moe["moe/expert_load"]).array), 1.0, rtol=1e-5)
    balance = float(moe["moe/load_balancing_loss"].array)
    assert 0 < balance < CONFIG.experts * CONFIG.top_k       # HF's E * sum over choices and experts of f * P
    assert float(moe["moe/dropped_fraction"].array) == 0.0
    # the cross-entropy alone: the same model with a zero coefficient
    plain = Llama(CONFIG.replace(load_balancing_coef=0.0), rngs=nnx.Rngs(0))
    ce = float(STEP(plain, batch)[0])
    assert float(loss) == pytest.approx(ce + CONFIG.load_balancing_coef * balance, rel=1e-5)
    router = grads["layers"]["ffn"]["router"]["kernel"].get_value()
    assert router.names == ("layers", "d_model", "expert_choice") and float(md.sum(md.square(router)).array) > 0


LAYOUTS = {
    "data": {"batch": "data"},
    "expert parallel": {"batch": "data", "experts": "data"},
    "expert parallel, Megatron inside the experts": {"batch": "data", "experts": "data", "d_ff": "model"},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_loss_and_gradients_are_the_unsharded_ones(model, batch, expected, name):
    got = md.lower(step, MESH, md.Layout(LAYOUTS[name]))(model, batch)
    assert_same(got, expected, rtol=2e-4, atol=2e-5)


def test_a_1f1b_pipeline_takes_the_router_metrics_per_microbatch(model, batch):
    """The metrics ride with the rows: a pipeline's loss is its microbatches' cross-entropy plus
    the mean of their balancing losses, as if each microbatch ran alone (microbatch i: each data
    shard's i-th row, rows i::2 here)."""
    layout = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": 2})
    got = md.lower(step, md.Mesh({"pipe": 2, "data": 4}), layout, schedule="1f1b")(model, batch)
    halves = [{k: md.named(v.array[i::2], v.names) for k, v in batch.items()} for i in range(2)]
    parts = [STEP(model, half) for half in halves]
    total = sum(float(md.sum(h["decoder_loss_weights"]).array) for h in halves)
    ce = [float(p[0]) - CONFIG.load_balancing_coef * float(p[1]["moe/load_balancing_loss"].array) for p in parts]
    weights = [float(md.sum(h["decoder_loss_weights"]).array) / total for h in halves]
    balance = np.mean([float(p[1]["moe/load_balancing_loss"].array) for p in parts])
    want = sum(w * c for w, c in zip(weights, ce)) + CONFIG.load_balancing_coef * balance
    assert float(got[0]) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("name", ["mixtral-tiny", "qwen2-moe-tiny"])
def test_kv_cache_decoding_equals_the_full_forward(name):
    """Every greedy token from the cache is the argmax of the whole sequence's forward at its
    position (the MoE on one position per step, Qwen's biases, the shared expert), unsharded and
    under expert parallelism."""
    config = get_config(name).replace(d_model=32, vocab=VOCAB, layers=2)
    model = Llama(config, rngs=nnx.Rngs(1))
    if config.qkv_bias:      # biases at init are zeros: make them count
        bias = model.layers.attention.k_bias
        bias.set_value(md.param(md.random.normal(jax.random.key(2), bias.get_value().dims)))
    prompt = np.random.RandomState(5).randint(2, VOCAB, (4, 5))
    got = np.asarray(meshdsl.models.generate(model, prompt, max_new_tokens=5, eos_id=-1).array)
    full = np.asarray(md.argmax(model(md.named(jnp.asarray(got), "batch length")), "vocab").array)
    np.testing.assert_array_equal(got[:, 5:], full[:, 4:-1])
    layout = md.Layout({"batch": "data", "experts": "data"})
    sharded = meshdsl.models.generate(model, prompt, max_new_tokens=5, eos_id=-1, mesh=MESH, layout=layout)
    np.testing.assert_array_equal(np.asarray(sharded.array), got)


def test_configs_count_their_experts_and_round_trip():
    for name, total in (("mixtral-8x7b", 46_702_792_704), ("qwen2-moe-a2.7b", 14_315_784_192)):
        c = get_config(name)
        assert c.is_moe and count_params(c) == total            # the published 46.7B and 14.3B
    dense = get_config("llama-tiny")
    assert not dense.is_moe and dense.experts == 0 and dense.expert_d_ff == dense.d_ff
    tiny = get_config("qwen2-moe-tiny")
    model = nnx.eval_shape(lambda: Llama(tiny, rngs=nnx.Rngs(0)))
    assert model.layers.ffn.experts.wi_0.kernel.get_value().names == ("layers", "experts", "d_model", "d_ff")
    assert model.layers.ffn.shared.wo.kernel.get_value().names == ("layers", "d_shared", "d_model")
    assert config_from_dict(dataclasses.asdict(tiny)) == tiny
    assert isinstance(tiny, LlamaConfig)


@pytest.mark.parametrize("changes, message", [
    (dict(experts=4, top_k=5), "top_k=5 must be in 1..experts=4"),
    (dict(experts=-1), "experts=-1 and shared_d_ff=0 must be >= 0"),
])
def test_impossible_configs_are_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        get_config("mixtral-tiny").replace(**changes)
