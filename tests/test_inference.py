"""Inference layouts and the decode roofline numbers (md.explain of one decode step, checked
against the compiled HLO), span filling on span-corruption batches, and the generate CLI."""

import types

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import meshdsl as md
import meshdsl.models
from helpers import explain_summary, hlo_summary
from meshdsl.models.configs import get_config
from meshdsl.models.decoding.decode import decode_logits
from meshdsl.models.decoding.inference import INFERENCE_LAYOUTS, _abstract_step_inputs, decode_step_cost
from meshdsl.models.generate import span_filling_accuracy, split_spans
from meshdsl.models.t5 import T5, count_params

MESH = md.Mesh({"data": 2, "model": 4})
CONFIG = get_config("t5-tiny", d_model=32, d_ff=64, heads=4, d_kv=8, vocab=128)


@pytest.fixture(scope="module")
def model():
    return T5(CONFIG, rngs=nnx.Rngs(0))


def test_decode_step_cost_under_the_inference_layouts(model):
    costs = {name: decode_step_cost(model, MESH, layout, batch=8, encoder_length=16, max_length=32)
             for name, layout in INFERENCE_LAYOUTS.items()}
    total = count_params(model) * 4
    assert costs["batch-split"]["param_bytes"] == total                   # every device reads every weight
    assert costs["batch-split"]["bytes_moved"] == 0                       # and moves nothing
    assert costs["weight-gathered"]["param_bytes"] == pytest.approx(total / 8, rel=0.05)
    assert costs["weight-gathered"]["bytes_moved"] > 0                    # stored split, gathered at use
    assert costs["1d-weight-stationary"]["param_bytes"] < costs["batch-split"]["param_bytes"] / 2
    assert costs["2d-weight-stationary"]["param_bytes"] < costs["1d-weight-stationary"]["param_bytes"]
    cache = 2 * 2 * 8 * 32 * 4 * 8 * 4       # (k, v) x layers x batch x kv_length x heads x d_kv x 4 bytes
    assert costs["batch-split"]["cache_bytes"] == cache / 8
    assert costs["kv-split"]["cache_bytes"] == cache / 8
    assert costs["1d-weight-stationary"]["cache_bytes"] == cache / 8      # batch on data, heads on model
    for c in costs.values():
        assert c["memory_read_per_token"] == c["param_bytes"] + c["cache_bytes"] + c["cross_bytes"]
        assert c["flops"] > 0


def test_decode_step_bytes_equal_the_compiled_hlo(model):
    layout = INFERENCE_LAYOUTS["1d-weight-stationary"]
    state, token = _abstract_step_inputs(model, 8, 16, 32)

    def step(m, s, t, pos):
        logits, s = decode_logits(m, s, t, pos)
        return md.argmax(logits, "vocab"), s

    f = md.lower(step, MESH, layout)
    args = (model, state, token, jnp.int32(3))
    assert hlo_summary(f, *args) == explain_summary(md.explain(step, MESH, layout, *args))


def test_span_filling_exact_match(monkeypatch):
    vocab = types.SimpleNamespace(sp_size=100, unpadded_size=128, eos_id=1, pad_id=0)
    s0, s1 = 127, 126                                   # <extra_id_0>, <extra_id_1>
    targets = np.array([[s0, 5, 6, s1, 7, 1, 0, 0],
                        [s0, 8, 1, 0, 0, 0, 0, 0],
                        [s0, 9, s1, 10, 11, 1, 0, 0]], np.int32)
    decoded = np.array([[0, s0, 5, 6, s1, 7, 1, 0, 0],    # both spans right
                        [0, s0, 8, 3, 1, 0, 0, 0, 0],     # one token too many
                        [0, s0, 9, s1, 10, 12, 1, 0, 0]], np.int32)  # second span wrong
    seen = {}

    def fake_generate(model, inputs, **kw):
        seen.update(kw, names=inputs.names)
        return md.named(decoded, "batch length")

    monkeypatch.setattr("meshdsl.models.decoding.generation.generate", fake_generate)
    batch = {"encoder_input_tokens": np.ones((3, 10), np.int32), "decoder_target_tokens": targets}
    result = span_filling_accuracy(None, [batch], vocab)
    assert result == {"exact_match": 1 / 3, "span_exact_match": 3 / 5, "examples": 3, "spans": 5}
    assert seen["max_new_tokens"] == 8 and seen["eos_id"] == 1 and seen["names"] == ("batch", "length")
    assert split_spans([s0, 5, 6, s1, 7, 1, 9], lambda t: t >= 100) == {s0: (5, 6), s1: (7,)}


def test_generate_cli_on_a_run_directory(tmp_path, capsys):
    import json

    import jax

    from meshdsl.models.training import checkpoint
    import importlib
    cli = importlib.import_module("meshdsl.models.generate")
    from meshdsl.models.data.corpus import load_vocabulary
    from meshdsl.models.train import build_parser
    from meshdsl.models.training.optim import make_optimizer
    from meshdsl.models.training.trainer import Trainer

    from meshdsl.models.generation import generate
    assert meshdsl.models.generate is generate           # importing the CLI module keeps the function
    vocab = load_vocabulary()
    config = CONFIG.replace(vocab=vocab.size)
    run = vars(build_parser().parse_args([]))
    mesh = md.Mesh({"data": 1}, devices=jax.devices()[:1])
    tx, schedule = make_optimizer(run["optimizer"], run["lr"], run["warmup"], run["steps"], run["decay"])
    state = Trainer(config, mesh, md.Layout({}), tx, schedule).init_state()
    checkpoint.save(str(tmp_path / "checkpoints"), 0, state)
    with open(tmp_path / "run.json", "w") as f:
        json.dump({**run, "config": config.__dict__, "mesh": str(mesh)}, f, default=str)
    assert vocab.sentinel(0) in cli.encode_prompt(vocab, "a <extra_id_0> b")
    texts = cli.main(["--run", str(tmp_path), "--prompt", "In the beginning <extra_id_0> earth", "--prompt", "And God",
                      "--max-new-tokens", "4", "--mesh", "data:2,model:4", "--layout", "batch:data;heads:model"])
    assert len(texts) == 2 and "->" in capsys.readouterr().out


def test_moe_t5_decodes_the_same_under_expert_parallelism():
    """GShard top-2 MoE-T5: one token per routing group at each step; experts split over data."""
    config = get_config("moe-t5-tiny", d_model=32, d_ff=64, heads=4, d_kv=8, vocab=128, expert_d_ff=64, top_k=2)
    moe = T5(config, rngs=nnx.Rngs(0))
    ids = np.random.RandomState(0).randint(2, 128, (4, 10))
    expected = meshdsl.models.generate(moe, ids, max_new_tokens=6)
    layout = md.Layout({"batch": "data", "group": "data", "experts": "data", "heads": "model"})
    got = meshdsl.models.generate(moe, ids, max_new_tokens=6, mesh=MESH, layout=layout)
    np.testing.assert_array_equal(np.asarray(got.array), np.asarray(expected.array))
