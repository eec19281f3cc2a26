"""Reference models: T5 and MoE-T5 are layout-invariant (forward and gradients under six
layouts), have the published parameter counts, and compile in a time that does not grow with depth."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from helpers import assert_same
from meshdsl.models.configs import get_config
from meshdsl.models.loss import t5_loss
from meshdsl.models.t5 import T5, count_params

PUBLISHED = {  # parameter counts of the released checkpoints
    "t5-small": 60_506_624, "t5-base": 222_903_552, "t5-large": 737_668_096, "t5-3b": 2_851_598_336,
    "t5-11b": 11_307_321_344, "t5-v1_1-small": 76_961_152, "t5-v1_1-base": 247_577_856,
    "t5-v1_1-large": 783_150_080, "t5-v1_1-xl": 2_849_757_184, "t5-v1_1-xxl": 11_135_332_352,
    "switch-base-8": 619_339_008,
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_parameter_counts(name):
    assert count_params(get_config(name)) == PUBLISHED[name]


TINY = dict(d_model=32, d_ff=64, heads=4, d_kv=8, encoder_layers=1, decoder_layers=1, vocab=64)
MESH = {"data": 2, "model": 4}
MEGATRON = {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}
DENSE_LAYOUTS = {
    "data": ({"batch": "data"}, None),
    "Megatron": (MEGATRON, None),
    "2-D": ({"d_model": "data", "d_ff": "model", "heads": "model"}, None),
    "ZeRO-3": ({"batch": "data"}, {"d_model": "data"}),
    "Megatron + ZeRO-3": (MEGATRON, {"d_model": "data"}),
    "Megatron sequence parallel": ({**MEGATRON, "length": "model"}, None),
}
MOE_LAYOUTS = {
    "data": ({"batch": "data", "group": "data"}, None),
    "expert parallel": ({"batch": "data", "group": "data", "experts": "data"}, None),
    "Megatron": (MEGATRON, None),
    "expert parallel + Megatron": ({**MEGATRON, "group": "data", "experts": "data"}, None),
    "ZeRO-3": ({"batch": "data", "group": "data"}, {"d_model": "data"}),
    "expert parallel, experts over both axes": ({"batch": "data", "group": "data", "experts": ("data", "model")},
                                                None),
}


def tiny(moe: bool):
    c = get_config("moe-t5-tiny" if moe else "t5-tiny").replace(**TINY)
    return c.replace(num_experts=8, expert_d_ff=32, moe_every=1) if moe else c  # one sparse layer each


@pytest.fixture(scope="module")
def batch():
    r = np.random.RandomState(0)
    b = {"encoder_input_tokens": r.randint(1, 64, (8, 16)), "decoder_input_tokens": r.randint(1, 64, (8, 8)),
         "decoder_target_tokens": r.randint(1, 64, (8, 8)), "decoder_loss_weights": np.ones((8, 8), np.float32)}
    b["decoder_loss_weights"][:, -2:] = 0
    return {k: md.named(jnp.asarray(v), "batch inputs" if k.startswith("encoder") else "batch targets")
            for k, v in b.items()}


def step(model, batch, key):
    """Logits, loss and gradients of a training step (dropout and router jitter on)."""
    def loss_fn(m):
        loss, metrics = t5_loss(m, batch, key=key, train=True)
        return loss.array, metrics
    (loss, metrics), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
    logits = model(batch["encoder_input_tokens"], batch["decoder_input_tokens"])
    return logits, loss, {k: v for k, v in metrics.items()}, grads


RANDOM = {(False, "Megatron"), (True, "expert parallel")}  # dropout and jitter on (costly to compile)


_REFERENCE = {}


def reference(moe, random, batch):
    """Model, key and the unsharded step's results (one device, global arrays), computed once."""
    if (moe, random) not in _REFERENCE:
        config = tiny(moe)
        if random:
            config = config.replace(dropout_rate=0.1, jitter_noise=0.01 if moe else 0.0)
        model, key = T5(config, rngs=nnx.Rngs(0)), jax.random.key(1)
        _REFERENCE[moe, random] = model, key, jax.jit(step)(model, batch, key)
    return _REFERENCE[moe, random]


# The three slowest cases (about 45 s each) run with -m slow; each layout's rules are still
# covered by a cheaper case in the default run (Megatron for MoE, expert parallel over both axes).
SLOW_CASES = {(False, "Megatron"), (True, "expert parallel"), (True, "expert parallel + Megatron")}


@pytest.mark.parametrize("moe, name", [
    pytest.param(moe, n, marks=[pytest.mark.slow] if (moe, n) in SLOW_CASES else [])
    for moe, names in ((False, DENSE_LAYOUTS), (True, MOE_LAYOUTS)) for n in names])
def test_model_forward_and_gradients_are_layout_invariant(moe, name, batch):
    model, key, expected = reference(moe, (moe, name) in RANDOM, batch)
    rules, params = (MOE_LAYOUTS if moe else DENSE_LAYOUTS)[name]
    got = md.lower(step, md.Mesh(MESH), md.Layout(rules, params=params))(model, batch, key)
    assert_same(got, expected, rtol=2e-4, atol=2e-5)


def test_model_initialised_inside_md_lower_is_placed_and_identical():
    config = tiny(False)
    layout = md.Layout(MEGATRON, params={"d_model": "data"})
    made = md.lower(lambda key: T5(config, rngs=nnx.Rngs(params=key)), md.Mesh(MESH), layout)(jax.random.key(0))
    reference = T5(config, rngs=nnx.Rngs(params=jax.random.key(0)))
    assert_same(nnx.state(made, nnx.Param), nnx.state(reference, nnx.Param), rtol=0, atol=0)
    kernel = made.encoder.layers[0].attention.q.kernel.get_value()
    assert kernel.array.sharding.spec == jax.sharding.PartitionSpec(None, "data", "model")


def count_equations(jaxpr) -> int:
    from meshdsl.costmodel.jaxpr_stats import sub_jaxprs
    return sum(1 + sum(count_equations(j) for j in sub_jaxprs(e)) for e in jaxpr.eqns)


def test_compiled_program_does_not_grow_with_depth(batch):
    """md.scan: the traced program of a 12-layer model is the size of a 2-layer one."""
    def size(layers):
        config = tiny(False).replace(encoder_layers=layers, decoder_layers=layers)
        model = nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0)))
        jaxpr = jax.make_jaxpr(lambda m, b: t5_loss(m, b)[0].array)(model, batch)
        return count_equations(jaxpr.jaxpr)

    assert size(12) == size(2)


def test_token_ids_with_other_names_and_lengths(batch):
    model = T5(tiny(False), rngs=nnx.Rngs(0))
    enc = md.named(batch["encoder_input_tokens"].array, "batch src")
    dec = md.named(batch["decoder_input_tokens"].array[:, :5], "batch tgt")
    logits = model(enc, dec)
    # vocab 64 padded to a multiple of 128 (the config's vocab_multiple)
    assert logits.names == ("batch", "tgt", "vocab") and logits.shape == {"batch": 8, "tgt": 5, "vocab": 128}
    with pytest.raises(md.ShapeError, match="integer token ids"):
        model(enc.astype(jnp.float32), dec)


def loss_and_grads(model, batch, key):
    return nnx.value_and_grad(lambda m: t5_loss(m, batch, key=key, train=True)[0].array)(model)


# both with -m slow (~35 s and ~20 s): the plan's keep / gather-again choice per stored weight is
# tests/test_zero3_weights_kept_or_gathered_again_by_the_plan.py's
@pytest.mark.parametrize("rules, stays", [pytest.param({"batch": "data"}, True, marks=pytest.mark.slow),
                                          pytest.param(MEGATRON, False, marks=pytest.mark.slow)],
                         ids=["ZeRO-3", "Megatron + ZeRO-3"])
def test_param_gather_auto_gathers_a_parameter_only_where_cheaper(rules, stays, batch):
    """A tied embedding [vocab:1024, d_model:128] stored d_model:data, read by two lookups and
    the logits; whether each op gathers it is the planner's decision (param_gather="auto"), in
    the same solve as every other placement. Data parallel: gathering it costs more than moving
    ids, rows and logits, so it is never gathered. Megatron (vocab:model): a plan no slower than
    gathering it everywhere ("keep": auto's strategies include keep's). Either way the step
    equals the unsharded one and md.explain = HLO."""
    from helpers import bytes_by_kind, explain_summary, hlo_summary
    config = tiny(False).replace(vocab=1024, d_model=128, tie_embeddings=True)
    model, key = T5(config, rngs=nnx.Rngs(0)), jax.random.key(1)
    mesh, layout = md.Mesh(MESH), md.Layout(rules, params={"d_model": "data"})
    f = md.lower(loss_and_grads, mesh, layout, param_gather="auto")
    assert_same(f(model, batch, key), jax.jit(loss_and_grads)(model, batch, key), rtol=2e-4, atol=2e-5)
    report = md.explain(loss_and_grads, mesh, layout, model, batch, key, param_gather="auto")
    table = [r for r in report.collectives if r.tensor.startswith("[vocab:1024 d_model:128]")]
    hlo = hlo_summary(f, model, batch, key)
    assert bytes_by_kind(explain_summary(report)) == pytest.approx(bytes_by_kind(hlo))
    keep = md.explain(loss_and_grads, mesh, layout, model, batch, key)
    if stays:
        assert not table and report.total_bytes < 0.8 * keep.total_bytes
    else:
        cpu = md.Hardware.profile("cpu")
        assert report.time(cpu).total_s <= keep.time(cpu).total_s * (1 + 1e-9)


def test_remat_policies_under_sequence_parallelism():
    """Megatron sequence parallel (length: model): "sequence-parallel" keeps the sequence shard and
    gathers it again in the backward pass (more all-gather bytes, no more reduce-scatters, less
    memory than keeping everything); "collectives" keeps what collectives made (no new bytes)."""
    config = get_config("t5-tiny")
    model = nnx.eval_shape(lambda: T5(config, rngs=nnx.Rngs(0)))
    shapes = {"encoder_input_tokens": (16, 64), "decoder_input_tokens": (16, 16), "decoder_target_tokens": (16, 16)}
    batch = {k: md.named(jax.ShapeDtypeStruct(s, jnp.int32), "batch inputs" if k.startswith("encoder")
                         else "batch targets") for k, s in shapes.items()}
    layout = md.Layout({"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model", "length": "model"})

    def report(policy):
        grads = lambda m, b: nnx.grad(lambda m: t5_loss(m, b, remat=policy)[0].array)(m)
        rep = md.explain(grads, md.Mesh.abstract(MESH), layout, model, batch)
        return {k: v["bytes"] for k, v in rep.summary().items()}, rep.memory["temporaries"]

    (none, mem_none), (sp, mem_sp), (coll, mem_coll) = map(report, ("none", "sequence-parallel", "collectives"))
    assert sp["all-gather"] > none["all-gather"] and sp["reduce-scatter"] == none["reduce-scatter"]
    assert sp["all-reduce"] == none["all-reduce"] and mem_sp < mem_none
    assert coll == none and mem_coll < mem_none
