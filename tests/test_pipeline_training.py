"""Pipelines in training: a T5 / MoE-T5 step under GPipe, 1F1B and circular schedules equals the
unsharded step, and the training CLI (``python -m meshdsl.models.train``) takes ``--microbatches``,
``--schedule`` and ``--repeats`` to md.lower, refuses what cannot run with one line, and gives the
data-parallel losses. The pipeline itself (values, gradients, explain, errors, random pipelines)
is tested in test_pipeline.py; most tests here are slow (``-m slow``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import meshdsl as md
from helpers import assert_same


# With -m slow (~60 to 80 s each on 2 cores; 1F1B: also the slow CLI tests). By default the pieces
# (test_pipeline_1f1b.py, test_pipeline.py): head aux values with dims, random numbers over a dim cut
# like the microbatches, random pipelines.
@pytest.mark.parametrize("model, schedule", [pytest.param("t5-tiny", "gpipe", marks=pytest.mark.slow),
                                             pytest.param("t5-tiny", "1f1b", marks=pytest.mark.slow),
                                             pytest.param("moe-t5-tiny", "1f1b", marks=pytest.mark.slow),
                                             pytest.param("t5-tiny", "circular", marks=pytest.mark.slow),
                                             pytest.param("moe-t5-tiny", "circular", marks=pytest.mark.slow)])
def test_t5_trains_under_a_pipeline_with_the_unsharded_step(model, schedule):
    """T5 (2 + 2 layers, dropout on) under pipe x data (x Megatron for dense T5) with 2 microbatches:
    the decoder captures the encoder output (cut per microbatch), dropout masks equal the unsharded
    ones. 1F1B: the decoder stack's loss (its head) runs inside the pipeline, the encoder's is
    GPipe; the metrics come back as the head's aux values. MoE-T5 (every FFN sparse, router jitter
    and expert dropout on): the decoder's router losses ride in the carry as sums per row and join
    the loss in the head; jitter and dropout draw over ``group``, numbered like ``batch``. Circular
    (2 repeats): the decoder's 4 layers in chunks of one, the encoder's stack GPipe."""
    from flax import nnx
    from meshdsl.models.configs import get_config
    from meshdsl.models.loss import t5_loss
    from meshdsl.models.t5 import T5

    repeats = 2 if schedule == "circular" else 1
    config = get_config(model).replace(d_model=32, d_ff=64, heads=4, d_kv=8, vocab=64, encoder_layers=2,
                                       decoder_layers=2 * repeats, dropout_rate=0.1)
    if config.is_moe:
        config = config.replace(expert_d_ff=64, moe_every=1, jitter_noise=0.01)
    model, key = T5(config, rngs=nnx.Rngs(0)), jax.random.key(1)
    r = np.random.RandomState(0)
    batch = {"encoder_input_tokens": md.named(jnp.asarray(r.randint(1, 64, (8, 16))), "batch inputs"),
             "decoder_input_tokens": md.named(jnp.asarray(r.randint(1, 64, (8, 8))), "batch targets"),
             "decoder_target_tokens": md.named(jnp.asarray(r.randint(1, 64, (8, 8))), "batch targets")}

    def step(model, batch, key):
        def loss_fn(m):
            loss, metrics = t5_loss(m, batch, key=key, train=True)
            return loss.array, metrics
        return nnx.value_and_grad(loss_fn, has_aux=True)(model)

    if config.is_moe:
        layout, mesh = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": 2}), \
            md.Mesh({"pipe": 2, "data": 4})
    else:
        layout = md.Layout({"batch": "data", "layers": "pipe", "heads": "model", "d_ff": "model"},
                           microbatches={"batch": 2})
        mesh = md.Mesh({"pipe": 2, "data": 2, "model": 2})
    f = md.lower(step, mesh, layout, schedule=schedule, repeats=repeats)
    got, want = f(model, batch, key), jax.jit(step)(model, batch, key)
    if config.is_moe:
        assert set(got[0][1]) >= {"moe/load_balancing_loss", "moe/router_z_loss", "moe/expert_load"}
        assert float(want[0][1]["moe/load_balancing_loss"].array) > 0
    assert_same(got, want, rtol=2e-4, atol=2e-5)


def _cli_records(tmp_path, model, override, runs, steps=3, batch=8):
    """The metrics.jsonl records of ``steps`` steps of the training CLI, one list per run's extra flags."""
    import json

    from meshdsl.models.train import main

    common = ["--model", model, "--override", override, "--batch", str(batch), "--encoder-length", "32",
              "--log-every", "1", "--no-explain", "--eval-batches", "0", "--steps", str(steps), "--ckpt-every", "0"]
    records = []
    for i, extra in enumerate(runs):
        out = str(tmp_path / f"run{i}")
        result = main([*common, *extra, "--out", out])
        schedule = extra[extra.index("--schedule") + 1] if "--schedule" in extra else "gpipe"
        assert result["trainer"].grad_fn.schedule == schedule
        with open(f"{out}/metrics.jsonl") as f:
            records.append([json.loads(line) for line in f])
        assert len(records[-1]) == steps
    return records


@pytest.mark.slow  # ~2 min; test_t5_trains_under_a_pipeline_with_the_unsharded_step[1f1b] checks the step by default
def test_training_cli_under_1f1b_gives_the_data_parallel_losses(tmp_path):
    """python -m meshdsl.models.train --mesh pipe:4,data:2 --layout batch:data;layers:pipe
    --microbatches 8 --schedule 1f1b (T5 with 4 + 4 layers): the first 10 losses and accuracies
    equal data parallel's."""
    override = "d_model=32,d_ff=64,heads=4,d_kv=8,encoder_layers=4,decoder_layers=4"
    pipe, data = _cli_records(tmp_path, "t5-tiny", override, [
        ["--mesh", "pipe:4,data:2", "--layout", "batch:data;layers:pipe", "--microbatches", "8", "--schedule", "1f1b"],
        ["--mesh", "data:8", "--layout", "batch:data"]], steps=10, batch=16)
    for key in ("loss", "accuracy"):
        np.testing.assert_allclose([r[key] for r in pipe], [r[key] for r in data], rtol=1e-5, atol=1e-6, err_msg=key)


@pytest.mark.slow  # ~50 s; test_t5_trains_under_a_pipeline_with_the_unsharded_step checks the same training by default
def test_training_cli_under_a_pipeline_gives_the_data_parallel_losses(tmp_path):
    """python -m meshdsl.models.train --mesh pipe:2,data:4 --layout batch:data;layers:pipe
    --microbatches 2 --schedule gpipe: the first losses equal data parallel's."""
    pipe, data = _cli_records(tmp_path, "t5-tiny", "d_model=32,d_ff=64,heads=4,d_kv=8", [
        ["--mesh", "pipe:2,data:4", "--layout", "batch:data;layers:pipe", "--microbatches", "2", "--schedule", "gpipe"],
        ["--mesh", "data:8", "--layout", "batch:data"]])
    np.testing.assert_allclose([r["loss"] for r in pipe], [r["loss"] for r in data], rtol=1e-5)


@pytest.mark.slow  # two MoE-T5 training runs through the CLI: ~1 min (python -m pytest -m slow)
def test_moe_t5_trains_under_a_pipeline_with_the_data_parallel_losses(tmp_path):
    """MoE-T5 (2 + 2 layers, every one sparse: moe_every=1, so each stage holds one) under pipe:2 x
    data:4 with 2 microbatches: the router's metrics are per token and routing groups are sequences
    (capacity per group), so the losses, the router losses and the dropped tokens equal data
    parallel's, drops included."""
    override = "d_model=32,d_ff=64,heads=4,d_kv=8,expert_d_ff=64,moe_every=1"
    pipe, data = _cli_records(tmp_path, "moe-t5-tiny", override, [
        ["--mesh", "pipe:2,data:4", "--layout", "batch:data;layers:pipe", "--microbatches", "2"],
        ["--mesh", "data:8", "--layout", "batch:data"]])
    for key in ("loss", "moe/load_balancing_loss", "moe/router_z_loss", "moe/dropped_fraction"):
        np.testing.assert_allclose([r[key] for r in pipe], [r[key] for r in data], rtol=1e-5, err_msg=key)
    np.testing.assert_allclose([r["moe/expert_load"] for r in pipe], [r["moe/expert_load"] for r in data], rtol=1e-5)
    assert data[0]["moe/dropped_fraction"] > 0          # capacity is tight: tokens are dropped, the same ones


def test_training_cli_refuses_a_schedule_that_does_not_exist(tmp_path, capsys):
    from meshdsl.models.train import main

    with pytest.raises(SystemExit) as e:
        main(["--mesh", "pipe:2,data:4", "--layout", "batch:data;layers:pipe", "--schedule", "zigzag",
              "--out", str(tmp_path / "run")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.strip() == "error: --schedule zigzag: is not a pipeline schedule; the schedules that exist: gpipe, " \
                          "1f1b, circular"


@pytest.mark.slow  # two MoE-T5 training runs through the CLI: ~2 min (python -m pytest -m slow)
def test_moe_t5_trains_under_1f1b_with_the_data_parallel_losses(tmp_path):
    """MoE-T5 (4 + 4 layers, every FFN sparse: a stage per layer) under --mesh pipe:4,data:2 --layout
    batch:data;layers:pipe --microbatches 8 --schedule 1f1b: the first 10 losses, router losses,
    dropped fractions and expert loads equal data parallel's."""
    override = "d_model=32,d_ff=64,heads=4,d_kv=8,expert_d_ff=64,moe_every=1,encoder_layers=4,decoder_layers=4"
    pipe, data = _cli_records(tmp_path, "moe-t5-tiny", override, [
        ["--mesh", "pipe:4,data:2", "--layout", "batch:data;layers:pipe", "--microbatches", "8", "--schedule", "1f1b"],
        ["--mesh", "data:8", "--layout", "batch:data"]], steps=10, batch=16)
    for key in ("loss", "accuracy", "moe/load_balancing_loss", "moe/router_z_loss", "moe/dropped_fraction"):
        np.testing.assert_allclose([r[key] for r in pipe], [r[key] for r in data], rtol=1e-5, atol=1e-6, err_msg=key)
    np.testing.assert_allclose([r["moe/expert_load"] for r in pipe], [r["moe/expert_load"] for r in data], rtol=1e-5)


def test_training_cli_passes_the_schedule_to_md_lower(tmp_path, capsys, monkeypatch):
    """--schedule and --repeats reach both md.lower calls of the trainer (the step's and evaluation's);
    with the CLI's own check out of the way, md.lower itself refuses repeats without circular."""
    from meshdsl.models.train import main
    from meshdsl.models.training import faults

    argv = ["--model", "t5-tiny", "--override", "d_model=32,d_ff=64,heads=4,d_kv=8", "--mesh", "pipe:2,data:4",
            "--layout", "batch:data;layers:pipe", "--microbatches", "2", "--out", str(tmp_path / "run")]
    lower, seen = md.lower, {}

    def spy(fn, mesh, layout, *args, **kwargs):
        name = getattr(fn, "__name__", "")
        seen[name] = (kwargs.get("schedule"), kwargs.get("repeats"))
        if name == "_eval_metrics":  # the trainer's last md.lower: stop before anything trains
            raise md.MeshDSLError("stopped by the test")
        return lower(fn, mesh, layout, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(md, "lower", spy)
        with pytest.raises(SystemExit) as e:
            main([*argv, "--schedule", "circular", "--repeats", "2"])
    assert e.value.code == 2 and "stopped by the test" in capsys.readouterr().err
    assert seen["_loss_and_grads"] == seen["_eval_metrics"] == ("circular", 2)

    monkeypatch.setattr(faults, "check_schedule", lambda name, repeats=1: None)
    with pytest.raises(SystemExit) as e:
        main([*argv, "--schedule", "gpipe", "--repeats", "2"])
    assert e.value.code == 2 and "md.lower: repeats=2 is the circular schedule's; pass schedule='circular'" in \
        capsys.readouterr().err


@pytest.mark.parametrize("extra, message", [
    (["--schedule", "gpipe", "--repeats", "2"],
     "error: --repeats 2 is the circular schedule's (chunks of the stack per pipeline stage), not gpipe's: pass "
     "--schedule circular, or leave out --repeats"),
    (["--repeats", "2"], "not gpipe's: pass --schedule circular"),          # gpipe is the default
    (["--schedule", "1f1b", "--repeats", "3"], "--repeats 3 is the circular schedule's"),
])
def test_training_cli_refuses_repeats_without_circular(tmp_path, capsys, extra, message):
    from meshdsl.models.train import main

    with pytest.raises(SystemExit) as e:
        main(["--mesh", "pipe:2,data:4", "--layout", "batch:data;layers:pipe", "--microbatches", "2", *extra,
              "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("value", ["0", "-1", "two"])
def test_training_cli_checks_repeats_at_parse_time(capsys, value):
    """--repeats is a count >= 1, checked like --microbatches (argparse: usage, then one error line)."""
    from meshdsl.models.train import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(["--schedule", "circular", "--repeats", value])
    assert e.value.code == 2
    (line,) = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.endswith(f"argument --repeats: must be >= 1, got {value}" if value != "two" else
                         "argument --repeats: expected an integer, got 'two'"), line


@pytest.mark.slow
def test_training_cli_under_circular_gives_the_data_parallel_losses(tmp_path):
    """python -m meshdsl.models.train --mesh pipe:2,data:4 --layout batch:data;layers:pipe
    --microbatches 2 --schedule circular --repeats 2 (T5 with 2 + 4 layers: the decoder's 4 in
    2 stages x 2 chunks; the encoder's stack runs GPipe): the first losses equal data parallel's,
    and run.json records the schedule and its repeats."""
    import json

    override = "d_model=32,d_ff=64,heads=4,d_kv=8,decoder_layers=4"
    pipe, data = _cli_records(tmp_path, "t5-tiny", override, [
        ["--mesh", "pipe:2,data:4", "--layout", "batch:data;layers:pipe", "--microbatches", "2",
         "--schedule", "circular", "--repeats", "2"],
        ["--mesh", "data:8", "--layout", "batch:data"]])
    np.testing.assert_allclose([r["loss"] for r in pipe], [r["loss"] for r in data], rtol=1e-4)
    with open(tmp_path / "run0" / "run.json") as f:
        run = json.load(f)
    assert (run["schedule"], run["repeats"]) == ("circular", 2)
