"""md.explain's memory: a liveness model of the per-device program (meshdsl.costmodel.liveness) that predicts
what XLA allocates. Checked against the compiled program's memory_analysis(): exact on small
programs whose buffers are known by hand, within 10% of the compiled peak (arguments + outputs +
temporaries) and 25% of its temporaries on t5-small training steps under the usual layouts and
remat policies, and on the Adam steps of bench/memory.md."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
from bench import memory as bench_memory, models as bench_models
from meshdsl.costmodel import liveness
from meshdsl.models.configs import get_config
from meshdsl.models.loss import t5_loss
from meshdsl.models.t5 import T5
from meshdsl.names.named import is_named

MEGATRON = {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}
LAYOUTS = {
    "data parallel": ("data:8", {"batch": "data"}, None),
    "Megatron": ("data:2;model:4", MEGATRON, None),
    "Megatron + sequence parallel": ("data:2;model:4", {**MEGATRON, "length": "model"}, None),
    "ZeRO-3": ("data:8", {"batch": "data"}, {"d_model": "data"}),
}


def _compiled_temporaries(f, *args) -> int:
    return jax.jit(f).lower(*args).compile().memory_analysis().temp_size_in_bytes


A = jnp.ones((128, 128), jnp.float32)
KIB64 = 128 * 128 * 4
SMALL = {   # program, its temporaries known by hand
    # a @ a dies where the output is written: one buffer beside the output
    "a matmul of a matmul": (lambda a: (a @ a) @ a, KIB64),
    # (a @ a) dies before the output is written: it lives in the output's buffer
    "three matmuls": (lambda a: ((a @ a) @ a) @ a, KIB64),
    "four matmuls": (lambda a: (((a @ a) @ a) @ a) @ a, 2 * KIB64),
    # an elementwise op on a dying matmul writes in place; a transpose read by a matmul is folded
    "in place, folded": (lambda a: ((a @ a) + 1.0, a.T @ a), 0),
    # a reshape is its operand's buffer
    "reshaped": (lambda a: ((a @ a).reshape(64, 256).reshape(128, 128)) @ a, KIB64),
    # m * 2 is not written into m, a result: two result buffers, a @ a lives in the second's
    "a result is never overwritten": (lambda a: (lambda m: (m, m * 2.0))((a @ a) @ a), 0),
    # a batched matmul reads its operands batch dim first: a transposed copy of [i b j]
    "a layout copy for a matmul": (lambda a: jnp.einsum("ibj,bjk->bik", a.reshape(128, 2, 64),
                                                        a.reshape(2, 64, 128)), KIB64),
}


@pytest.mark.parametrize("name", SMALL)
def test_the_temporaries_of_small_programs_are_known_exactly(name):
    fn, expected = SMALL[name]
    predicted = liveness.memory(jax.make_jaxpr(fn)(A))
    assert predicted["temporaries"] == expected == _compiled_temporaries(fn, A)
    assert sum(predicted["breakdown"].values()) == predicted["temporaries"]


STACK = jnp.ones((4, 128, 128), jnp.float32)


def _loop(a):
    """c <- tanh(c @ w) over the four slices w of STACK."""
    return jax.lax.scan(lambda c, w: (jnp.tanh(c @ w), None), a, STACK)[0]


def test_a_loop_bodys_buffers_live_on_the_programs_clock():
    """A loop body's buffers are the program's, live while the body runs: the slice of the
    stacked operand the body's matmul reads (XLA slices it into a buffer of its own) and the
    matmul's result, the new carry (tanh writes into it): two blocks of 64 KiB. XLA adds its loop
    counters (under 1 KiB)."""
    predicted = liveness.memory(jax.make_jaxpr(_loop)(A))
    compiled = _compiled_temporaries(_loop, A)
    assert predicted["temporaries"] == 2 * KIB64
    assert 0 <= compiled - predicted["temporaries"] < 1024, compiled


def _batch(cfg, batch, enc, dec):
    r = np.random.RandomState(0)
    arrays = {"encoder_input_tokens": r.randint(1, cfg.vocab, (batch, enc)),
              "decoder_input_tokens": r.randint(1, cfg.vocab, (batch, dec)),
              "decoder_target_tokens": r.randint(1, cfg.vocab, (batch, dec)),
              "decoder_loss_weights": np.ones((batch, dec), np.float32)}
    return {k: md.named(jnp.asarray(v), "batch inputs" if k.startswith("encoder") else "batch targets")
            for k, v in arrays.items()}


@pytest.fixture(scope="module")
def t5():
    """t5-small widths, 2 + 2 layers, batch 16 x 128 / 32 tokens (the issue's sizes)."""
    cfg = get_config("t5-small").replace(encoder_layers=2, decoder_layers=2, dropout_rate=0.0)
    return T5(cfg, rngs=nnx.Rngs(0)), _batch(cfg, 16, 128, 32)


def _train_step(remat):
    def step(model, batch):
        return nnx.value_and_grad(lambda m: t5_loss(m, batch, train=True, remat=remat)[0].array)(model)
    return step


@pytest.mark.parametrize("remat", ["none", "full"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_explain_memory_is_within_10_percent_of_the_compiled_peak(t5, layout, remat):
    model, batch = t5
    mesh, rules, params = LAYOUTS[layout]
    _within_bounds(md.explain(_train_step(remat), md.Mesh.parse(mesh), md.Layout(rules, params=params), model, batch))


def _within_bounds(report):
    predicted, compiled = report.memory, report.compiled_memory()
    peak = compiled["arguments"] + compiled["outputs"] + compiled["temporaries"]
    assert predicted["arguments"] == compiled["arguments"]
    assert abs(predicted["peak"] / peak - 1) <= 0.10, (predicted, compiled)
    assert abs(predicted["temporaries"] / compiled["temporaries"] - 1) <= 0.25, (predicted, compiled)
    assert sum(predicted["breakdown"].values()) == predicted["temporaries"]


@pytest.fixture(scope="module")
def adam():
    """bench/memory.md's model and batch: t5-small widths, 2 + 2 layers, batch 8 x 64 / 16 tokens."""
    cfg, s = bench_models.config("dense", 2, True), bench_models.shapes(True)
    graphdef, state = nnx.split(bench_models.build(cfg, abstract=True))
    return graphdef, state, bench_models.batch_for(cfg, s["batch"], s["enc"], s["dec"], abstract=True)


@pytest.mark.parametrize("layout", bench_memory.CASES)
def test_explain_memory_of_an_adam_step_is_within_the_same_bounds(adam, layout):
    """Loss, gradients and an Adam update in one program (bench/memory.md's rows): the results
    (parameters, moments) host most temporaries, so what is left is small and sensitive to
    where XLA puts each buffer."""
    graphdef, state, batch = adam
    mesh, rules, stored, marked = bench_memory.CASES[layout]
    tree = jax.tree_util.tree_map
    params = tree(lambda p: p if marked else md.NamedArray(p.raw, p.dims), state, is_leaf=is_named)
    moments = tree(lambda p: md.param(md.NamedArray(p.raw, p.dims)), state, is_leaf=is_named)
    _within_bounds(md.explain(bench_memory.adam_step(graphdef, marked), md.Mesh.parse(mesh),
                              md.Layout(rules, params=stored), params, moments, moments, batch))


def test_the_peak_is_broken_down_by_what_holds_it():
    """``memory["kinds"]``: parameters (``md.param``), optimizer state (under ``opt_state``), other
    inputs, parameter outputs (gradients, updated parameters), other outputs, and the
    temporaries at the peak by what made them; they add up to the peak."""
    def arg(spec, param=False):
        s = md.shape(spec)
        x = md.named(jax.ShapeDtypeStruct(s.sizes, jnp.float32), s.names)
        return md.param(x) if param else x
    params = {"w1": arg("d_model:256 d_ff:1024", True), "w2": arg("d_ff:1024 d_model:256", True)}
    state = {"opt_state": {"mu": {k: arg(str(v.dims)) for k, v in params.items()}}}
    x = arg("batch:64 d_model:256")

    def step(params, state, x):
        def loss(p):
            h = md.relu(md.einsum(x, p["w1"], out="batch d_ff"))
            return md.sum(md.square(md.einsum(h, p["w2"], out="batch d_model"))).array
        value, grads = jax.value_and_grad(loss)(params)
        mu = {k: 0.9 * m + 0.1 * grads[k] for k, m in state["opt_state"]["mu"].items()}
        return md.named(value, ""), grads, mu
    r = md.explain(step, md.Mesh.abstract({"data": 2, "model": 4}), md.Layout.parse("batch:data;d_ff:model"),
                   params, state, x)
    kinds = r.memory["kinds"]
    weights = 2 * 256 * 1024 * 4 // 4   # split over model
    assert kinds["parameters"] == weights and kinds["parameter outputs"] == weights
    assert kinds["optimizer state"] == 2 * 256 * 1024 * 4 // 4   # the moments are placed as the layout says
    assert kinds["inputs"] == 32 * 256 * 4 and kinds["other outputs"] == 4 + weights   # the loss, the new moments
    assert sum(kinds.values()) == r.memory["peak"]
    assert set(kinds) - {"parameters", "optimizer state", "inputs", "parameter outputs", "other outputs"} \
        == set(r.memory["breakdown"])
