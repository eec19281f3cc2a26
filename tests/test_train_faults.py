"""The training CLI under faults: preemption, kill -9 during a save, NaN, corrupted checkpoints,
changed runs on resume, and user mistakes that must fail fast with one clear line.

An uninterrupted 8-step run is trained once per session (pytest-xdist workers share it on disk)
and copied or read by the other tests. The preemption test stops the same run by SIGTERM after
step 3 (it saves step 4), resumes it in a subprocess that is killed with SIGKILL while saving step 6,
and resumes again to the end, which must equal the uninterrupted run bit for bit. The signals are
sent by the process to itself at a given step (hidden ``--debug-signal STEP:NAME``), so nothing
depends on timing. Multi-process runs that lose a process: test_supervisor.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

import meshdsl as md
from helpers import RUN, SMALL
from meshdsl.models.train import main, parse_args
from meshdsl.models.training import checkpoint
from meshdsl.models.training.faults import Diverged, ExchangeOverflow, Preemption, UsageError, mesh_warnings


def is_named(x) -> bool:
    return isinstance(x, md.NamedArray)


def leaves(tree) -> list[np.ndarray]:
    return [np.asarray(x.array if is_named(x) else x) for x in jax.tree_util.tree_leaves(tree, is_leaf=is_named)]


def cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "JAX_PLATFORMS": "cpu"}
    return subprocess.run([sys.executable, "-m", "meshdsl.models.train", *args], env=env, capture_output=True,
                          text=True, timeout=600)


def metrics(out) -> list[dict]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="session")
def full(tmp_path_factory, worker_id) -> str:
    """The uninterrupted 8-step run's --out, trained once per session (pytest-xdist workers share it)."""
    from filelock import FileLock
    root = tmp_path_factory.getbasetemp()
    root = root.parent if worker_id != "master" else root
    out = root / "faults-full"
    with FileLock(str(out) + ".lock"):
        if not (out / "done").exists():
            shutil.rmtree(out, ignore_errors=True)
            main([*RUN, "--out", str(out)])
            (out / "done").write_text("")
    return str(out)


def restored(out: str, like, step: int | None = None):
    return checkpoint.restore(os.path.join(out, "checkpoints"), like, md.Mesh.parse("data:8"),
                              md.Layout.parse("batch:data"), step)


@pytest.mark.slow  # ~1 min; the other preemption tests run by default
def test_sigterm_then_kill_during_a_save_then_resume_is_bit_exact(request, tmp_path):
    out = str(tmp_path / "preempted")
    term = main([*RUN, "--out", out, "--debug-signal", "3:TERM"])  # a real SIGTERM, to this process
    assert term["stopped"] == "SIGTERM" and term["records"][-1]["step"] == 4  # saved at the next boundary
    assert checkpoint.complete_steps(os.path.join(out, "checkpoints")) == [2, 4]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored

    killed = cli(*RUN, "--out", out, "--resume", "--debug-signal", "6:KILL")  # kill -9 while saving step 6
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    assert "resumed from step 4" in killed.stdout
    left = sorted(os.listdir(os.path.join(out, "checkpoints")))
    # the save of step 6 was cut short (an orbax temporary directory) or had just finished
    assert any(n.startswith("6.orbax-checkpoint-tmp") or n == "6" for n in left), left

    resumed = main([*RUN, "--out", out, "--resume", "--export-hf", str(tmp_path / "hf")])
    full = request.getfixturevalue("full")  # only now: another xdist worker trains it meanwhile
    assert [r["loss"] for r in metrics(out)] == [r["loss"] for r in metrics(full)]
    assert sorted(os.listdir(tmp_path / "hf")) == ["config.json", "model.safetensors", "spiece.model"]
    for a, b in zip(leaves(restored(full, resumed["state"], 8)), leaves(resumed["state"])):
        np.testing.assert_array_equal(a, b)
    steps = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert steps == ["4", "6", "8"]  # temporary directories swept, --keep 3
    for s in steps:
        assert checkpoint.check_step(os.path.join(out, "checkpoints", s)) is None


def test_corrupted_checkpoint_names_step_file_and_the_intact_step(full, tmp_path, capsys):
    out = tmp_path / "corrupt"
    shutil.copytree(full, out)
    data = [os.path.join(d, f) for d, _, fs in os.walk(out / "checkpoints" / "8") for f in fs if "/d/" in d + "/"]
    with open(data[0], "r+b") as f:  # random bytes into a saved data file
        f.seek(2)
        f.write(os.urandom(8))
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--out", str(out), "--resume"])
    assert e.value.code == 2
    message = capsys.readouterr().err
    assert "checkpoint step 8" in message and data[0] in message and "--resume-from 6" in message
    assert "Traceback" not in message
    # taking the advice: resume from step 6, step 8 moved aside, trains steps 7 and 8 again
    again = main([*RUN, "--out", str(out), "--resume-from", "6"])
    assert [r["step"] for r in again["records"]] == [7, 8]
    assert [r["loss"] for r in again["records"]] == [r["loss"] for r in metrics(full)[6:]]
    assert os.path.isdir(str(out / "checkpoints") + ".superseded/8")


def test_nan_stops_without_saving_and_keeps_the_good_checkpoints(tmp_path, capsys):
    out = tmp_path / "nan"
    with pytest.raises(Diverged) as e:
        main([*RUN, "--out", str(out), "--debug-nan-at-step", "5", "--keep", "1", "--profile-steps", "2:3"])
    assert e.value.code == 3 and e.value.step == 5
    message = capsys.readouterr().err
    assert "step 5: not finite" in message and "nan" in message and "step 4" in message
    assert checkpoint.complete_steps(str(out / "checkpoints")) == [4]  # the last finite one, kept
    assert max(r["step"] for r in metrics(out)) == 4
    # on the way: TensorBoard event files next to metrics.jsonl, a profiler trace of steps 2..3
    if importlib.util.find_spec("tensorboardX"):
        assert any(n.startswith("events.out.tfevents") for n in os.listdir(out / "tensorboard"))
    assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(out / "profile") for f in fs)


def test_a_dropless_moe_step_over_its_exchange_bound_stops_the_run(tmp_path, capsys):
    """mixtral-tiny under expert parallelism with a stated exchange bound of half a balanced
    routing's rows: the first step's overflow is counted, never silently dropped - the run stops
    there, saving nothing, and says what to change."""
    run = ["--model", "mixtral-tiny", "--batch", "8", "--decoder-length", "16", "--steps", "3", "--no-explain",
           "--eval-batches", "0", "--layout", "batch:data;experts:data", "--override", "exchange_factor=0.5"]
    with pytest.raises(ExchangeOverflow) as e:
        main([*run, "--out", str(tmp_path / "bound"), "--ckpt-every", "1"])
    assert e.value.code == 3 and e.value.step == 1
    message = capsys.readouterr().err
    assert re.search(r"step 1: the routing sent some device more token assignments than exchange_factor=0.5 "
                     r"holds \(\d+\.\d+% of them, given zeros\); stopped without saving this state. Raise it "
                     r"\(--override exchange_factor=1\)", message), message
    assert checkpoint.complete_steps(str(tmp_path / "bound" / "checkpoints")) == []


def test_resume_refuses_a_changed_run(full, capsys):
    out = full
    with pytest.raises(UsageError):
        main([*RUN, "--out", out, "--resume", "--steps", "20", "--seed", "1", "--batch", "16"])
    message = capsys.readouterr().err
    assert "steps: 8 -> 20" in message and "seed: 0 -> 1" in message and "batch: 8 -> 16" in message
    assert "--allow-changes" in message
    with open(os.path.join(out, "run.json")) as f:
        assert json.load(f)["steps"] == 8  # not overwritten


def test_allow_changes_cannot_change_shapes(full, tmp_path, capsys):
    out = tmp_path / "wider"
    shutil.copytree(full, out)
    with pytest.raises(SystemExit) as e:
        main([*RUN, "--out", str(out), "--resume", "--allow-changes", "--override", "d_model=48"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "damaged" not in err and "Traceback" not in err, err
    assert "checkpoint step 8" in err and "does not fit this run's shapes" in err
    assert re.search(r"params/decoder/\S+/kernel is \(2, 32, 4, 8\) there but \(2, 48, 4, 8\) here", err), err
    assert "--allow-changes cannot change the shapes" in err
    assert checkpoint.complete_steps(str(out / "checkpoints")) == [4, 6, 8]  # nothing moved or deleted


def test_eval_only(full):
    out = full
    result = main([*RUN, "--out", out, "--eval-only", "--eval-batches", "2", "--eval-decode", "1"])
    record = result["records"][0]
    assert record["step"] == 8 and np.isfinite(record["val_loss"])
    # span filling by greedy decoding: a fraction of the sentinel spans reproduced exactly
    assert 0.0 <= record["val_span_exact_match"] <= 1.0 and 0.0 <= record["val_exact_match"] <= 1.0
    with open(os.path.join(out, "eval.jsonl")) as f:
        last = json.loads(f.readlines()[-1])
    assert last["step"] == 8 and "val_span_exact_match" in last
    # without the data options: the run's (run.json: batch 8, encoder length 32), the same examples
    again = main(["--override", SMALL, "--out", out, "--eval-only", "--eval-batches", "2", "--no-explain"])
    assert again["records"][0]["val_loss"] == record["val_loss"]
    args = parse_args(["--out", out, "--eval-only", "--encoder-length", "16"])  # the command line wins
    assert (args.batch, args.encoder_length, args.seed, args.task) == (8, 16, 0, "span_corruption")


@pytest.mark.parametrize("extra, message", [
    (["--resume"], "--resume: no checkpoint under"),
    (["--out", "/dev/null/run"], "is not a writable directory"),
    (["--batch", "8", "--accum", "2"], "multiple of 8"),
    (["--override", "d_mdl=3"], "--override"),
    (["--mesh", "data:3"], "mesh"),
])
def test_user_mistakes_are_one_line_and_exit_2(tmp_path, capsys, extra, message):
    argv = [*RUN, "--out", str(tmp_path / "run"), *extra] if "--out" not in extra else [*RUN, *extra]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err


def test_bad_text_files_name_the_file(tmp_path, capsys):
    binary, empty, latin = tmp_path / "data.bin", tmp_path / "empty.txt", tmp_path / "latin.txt"
    binary.write_bytes(os.urandom(64) + b"\0")
    empty.write_text("\n  \n")
    latin.write_bytes("caf\xe9 au lait\nsecond line\n".encode("latin-1"))
    for path, reason in [(binary, "binary"), (empty, "is empty"), (latin, "not UTF-8"),
                         (tmp_path / "missing.txt", "no such file")]:
        with pytest.raises(SystemExit) as e:
            main([*RUN, "--out", str(tmp_path / "run"), "--text-files", str(path)])
        err = capsys.readouterr().err
        assert e.value.code == 2 and str(path) in err and reason in err, err


def test_corrupt_vocabulary_cache_names_the_file(tmp_path, monkeypatch, capsys):
    from meshdsl.models.data import corpus
    monkeypatch.setenv("MESHDSL_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "own.txt"
    text.write_text("\n".join(f"line {i} of my own text with some words in it" for i in range(400)))
    corpus.load_vocabulary([str(text)])  # trains and caches it
    (cached,) = (tmp_path / "cache" / "vocab").iterdir()
    cached.write_bytes(b"not a sentencepiece model")
    corpus._cached_vocabulary.cache_clear()
    with pytest.raises(SystemExit):
        main([*RUN, "--out", str(tmp_path / "run"), "--text-files", str(text)])
    err = capsys.readouterr().err
    assert str(cached) in err and "delete it" in err


def test_full_disk_is_refused_before_compiling(tmp_path, monkeypatch, capsys):
    import shutil as shutil_module
    usage = shutil_module.disk_usage(tmp_path)
    monkeypatch.setattr(shutil_module, "disk_usage", lambda path: usage._replace(free=1000))
    with pytest.raises(SystemExit):
        main([*RUN, "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "a checkpoint needs about" in err and "1000 B is free" in err


def test_arguments_are_checked_at_parse_time(tmp_path, capsys):
    for bad in (["--steps", "-5"], ["--batch", "0"], ["--lr", "nan"], ["--profile-steps", "5:2"]):
        with pytest.raises(SystemExit) as e:
            parse_args(bad)
        assert e.value.code == 2
    assert "--steps: must be >= 1, got -5" in capsys.readouterr().err
    help_text = __import__("meshdsl.models.train", fromlist=["build_parser"]).build_parser().format_help()
    assert "moe-t5-tiny" in help_text and "t5-base" in help_text


def test_config_file_yaml_and_json(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("model: t5-small\nsteps: 12\nbatch: 16\noptimizer: adamw\nlr: 0.003\n")
    args = parse_args(["--config", str(yaml_file), "--steps", "20"])
    assert (args.model, args.steps, args.batch, args.optimizer, args.lr) == ("t5-small", 20, 16, "adamw", 0.003)
    json_file = tmp_path / "run.json"
    json_file.write_text(json.dumps({"steps": -3}))
    with pytest.raises(UsageError, match="steps: must be >= 1"):
        parse_args(["--config", str(json_file)])
    json_file.write_text(json.dumps({"stpes": 3}))
    with pytest.raises(UsageError, match="unknown key 'stpes'"):
        parse_args(["--config", str(json_file)])


def test_config_file_from_a_run_json_reproduces_the_run(full):
    args = parse_args(["--config", os.path.join(full, "run.json")])
    assert (args.steps, args.batch, args.encoder_length, args.ckpt_every) == (8, 8, 32, 2)


def test_second_ctrl_c_quits_at_once():
    messages = []
    before = signal.getsignal(signal.SIGINT)   # the default handler, or SIG_IGN in an xdist worker
    with Preemption(notify=messages.append) as stop:
        stop.handle(signal.SIGINT)
        assert stop.requested == "SIGINT" and "Ctrl-C again" in messages[0]
        with pytest.raises(KeyboardInterrupt):
            stop.handle(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is before   # the previous handler is back


def test_mesh_axis_without_a_rule_warns():
    mesh = md.Mesh.parse("data:2,model:4")
    (warning,) = mesh_warnings(mesh, md.Layout.parse("batch:data"))
    assert "'model'" in warning and "replicated 4x" in warning
    assert mesh_warnings(mesh, md.Layout.parse("batch:data;heads:model")) == []


def test_export_a_run_as_a_hugging_face_directory(full, tmp_path):
    from meshdsl.models import hf
    from meshdsl.models.export import main as export_main
    out = export_main(["--run", full, "--out", str(tmp_path / "hf")])
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "spiece.model"]
    model = hf.load_pretrained(out)
    from meshdsl.models.configs import T5Config
    with open(os.path.join(full, "run.json")) as f:
        trained = T5Config(**json.load(f)["config"])
    hf_side = ("activation", "tie_embeddings", "d_model", "d_ff", "heads", "d_kv", "encoder_layers", "vocab")
    assert all(getattr(model.config, k) == getattr(trained, k) for k in hf_side)
    kernel = model.encoder.layers[0].ffn.wi_0.kernel.get_value()  # [layers, d_model, d_ff], from HF's tensors
    assert kernel.names == ("layers", "d_model", "d_ff") and np.isfinite(np.asarray(kernel.array)).all()


def test_unfinished_saves_are_not_checkpoints(tmp_path):
    import jax.numpy as jnp
    state = {"w": md.param(md.named(jnp.arange(16.0).reshape(8, 2), "batch d")), "step": jnp.int32(3)}
    directory = str(tmp_path / "c")
    checkpoint.save(directory, 3, state)
    os.makedirs(os.path.join(directory, "9"))  # an empty numbered directory
    os.makedirs(os.path.join(directory, "7.orbax-checkpoint-tmp-123", "default"))  # a save cut short
    assert checkpoint.latest_step(directory) == 3
    ckpts = checkpoint.Checkpoints(directory)  # a run that goes on: sweeps both before its first save
    assert any("9" in note for note in ckpts.notes)
    ckpts.save(4, state)
    ckpts.close()
    assert sorted(os.listdir(directory)) == ["3", "4"]
    back = checkpoint.restore(directory, state, md.Mesh.parse("data:8"), md.Layout.parse("batch:data"))
    np.testing.assert_array_equal(np.asarray(back["w"].array), np.asarray(state["w"].array))


def test_a_failed_save_says_how_much_space_it_needed(tmp_path, monkeypatch):
    import errno

    import jax.numpy as jnp
    ckpts = checkpoint.Checkpoints(str(tmp_path / "c"))

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(ckpts._mgr, "save", disk_full)
    with pytest.raises(checkpoint.CheckpointError, match=r"step 7 .*No space left on device.*needs about 256\.00 KiB"):
        ckpts.save(7, {"w": jnp.zeros((256, 256), jnp.float32)})
    ckpts.close()


def test_bfloat16_compute_keeps_float32_parameters_and_optimizer_state():
    """--dtype bfloat16: matmuls in bf16, while parameters, gradients, optimizer state and loss stay
    float32 (traced, not compiled: XLA:CPU compiles bf16 steps slowly)."""
    import jax.numpy as jnp

    from meshdsl.models.configs import get_config
    from meshdsl.models.training.optim import make_optimizer
    from meshdsl.models.training.trainer import Trainer
    config = get_config("t5-tiny").replace(vocab=128, d_model=32, d_ff=64, heads=4, d_kv=8)
    tx, schedule = make_optimizer("adafactor", None, None, 10)
    trainer = Trainer(config, md.Mesh.parse("data:8"), md.Layout.parse("batch:data"), tx, schedule,
                      dtype=jnp.bfloat16)
    state = trainer.abstract_state()
    batch = {k: jax.ShapeDtypeStruct((1, 8, n), jnp.int32) for k, n in [
        ("encoder_input_tokens", 16), ("decoder_input_tokens", 8), ("decoder_target_tokens", 8),
        ("decoder_loss_weights", 8)]}
    new, out = jax.eval_shape(trainer._train_step, state, batch)
    floats = {str(x.dtype) for x in jax.tree_util.tree_leaves((new["params"], new["opt_state"]))} - {"int32"}
    assert floats == {"float32"} and out["loss"].dtype == out["grad_norm"].dtype == jnp.float32
    text = str(jax.make_jaxpr(trainer._train_step)(state, batch))
    assert text.count("preferred_element_type=bfloat16") > text.count("dot_general") // 2
