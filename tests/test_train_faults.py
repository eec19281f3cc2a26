"""The training CLI under faults: preemption, kill -9 during a save, NaN, corrupted checkpoints,
changed runs on resume, and user mistakes that must fail fast with one clear line.

An uninterrupted 8-step run is trained once per session (pytest-xdist workers share it on disk)
and copied or read by the other tests. The preemption test stops the same run by SIGTERM after
step 3 (it saves step 4), resumes it in a subprocess that is killed with SIGKILL while saving step 6,
and resumes again to the end, which must equal the uninterrupted run bit for bit. The signals are
sent by the process to itself at a given step (hidden ``--debug-signal STEP:NAME``), so nothing
depends on timing.

Multi-process runs (models/supervisor.py): the supervisor is tested on a stand-in child (a lost
peer's C++ abort becomes one line, other failures pass through, SIGTERM is passed on, the child dies
with a killed supervisor), then two real processes x 4 CPU devices lose process 1 to SIGKILL.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time

import jax
import numpy as np
import pytest

import meshdsl as md
from meshdsl.models import checkpoint, supervisor
from meshdsl.models.faults import Diverged, Preemption, UsageError, mesh_warnings
from meshdsl.models.train import main, parse_args

SMALL = "d_model=32,d_ff=64,heads=4,d_kv=8"
RUN = ["--override", SMALL, "--batch", "8", "--encoder-length", "32", "--log-every", "1", "--no-explain",
       "--eval-batches", "0", "--steps", "8", "--ckpt-every", "2"]


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
    from meshdsl.models import corpus
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
    from meshdsl.models.optim import make_optimizer
    from meshdsl.models.trainer import Trainer
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


# -- multi-process runs: a dead peer is one line (models/supervisor.py) ------------------------------

#: what jax 0.10's coordination service writes when process 0 finds process 1 dead (then SIGABRT)
PEER_ABORT = """\
E1123 00:05:47.182181   14689 coordination_service.cc:1549] [7399819470931903196] Use error polling to propagate \
the following error to all tasks: UNAVAILABLE: The following tasks are unhealthy (stopped sending heartbeats):
1
The tasks have crashed. Check the task logs for an earlier error, or scheduler events (e.g. preemption, eviction) \
to debug further. [type.googleapis.com/tensorflow.CoordinationServiceError='']
F1123 00:05:47.182943   14706 client.h:80] Terminating process because the JAX distributed service detected fatal \
errors. This most likely indicates that another task died; see the other task logs for more details.
*** Check failure stack trace: ***
    @     0x7f0153440634  absl::lts_20260107::log_internal::LogMessage::SendToLog()
"""
#: a stand-in for the training process: what it does is its first argument
FAKE_CHILD = """\
import os, signal, sys, time
mode = sys.argv[1]
if mode == "peer":
    sys.stderr.write("[Gloo] Rank 0 is connected to 7 peer ranks.\\n" + open(sys.argv[2]).read())
    sys.stderr.flush()
    os.abort()
if mode == "other":
    sys.stderr.write("W1123 00:05:40.000000   14689 cpu_client.cc:12] a warning\\nnot a glog line\\n")
    sys.stderr.write("F1123 00:05:47.182943   14706 dot.cc:80] Check failed: lhs == rhs\\n")
    sys.stderr.flush()
    os.abort()
if mode == "term":
    signal.signal(signal.SIGTERM, lambda *a: (print("child: SIGTERM, saved", flush=True), sys.exit(0)))
    from meshdsl.models.supervisor import watch_parent
    watch_parent()
    print(os.getpid(), file=sys.stderr, flush=True)
    time.sleep(60)
    sys.exit(1)
"""


def _supervised(tmp_path, mode: str, capfd=None):
    """Run the supervisor on the stand-in child (in this process when ``capfd`` is given)."""
    fake = tmp_path / "fake_child.py"
    fake.write_text(FAKE_CHILD)
    abort_text = tmp_path / "abort.txt"
    abort_text.write_text(PEER_ABORT)
    argv = ["--coordinator", "127.0.0.1:1234", "--num-processes", "2", "--process-id", "0",
            "--heartbeat-timeout", "7", "--out", str(tmp_path / "run")]
    extra = [mode, str(abort_text)]
    if capfd is not None:
        return supervisor.supervise(extra, parse_args(argv), command=[sys.executable, str(fake)])
    script = ("import sys; from meshdsl.models import supervisor; from meshdsl.models.train import parse_args; "
              f"sys.exit(supervisor.supervise({extra!r}, parse_args({argv!r}), command=[sys.executable, {str(fake)!r}]))")
    return subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_supervisor_turns_a_lost_peer_into_one_line(tmp_path, capfd):
    run = tmp_path / "run"
    os.makedirs(run / "checkpoints" / "5")
    (run / "checkpoints" / "5" / "_CHECKPOINT_METADATA").write_text("{}")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 8)))
    assert _supervised(tmp_path, "peer", capfd) == 4
    out, err = capfd.readouterr()
    assert err.splitlines()[0].startswith("[Gloo]")
    (line,) = err.splitlines()[1:]
    assert line.startswith("error: process 1 of 2 stopped responding (no heartbeat for 7 s, coordinator "
                           "127.0.0.1:1234) after step 7"), line
    assert f"the last checkpoint is step 5 in {run / 'checkpoints'}: restart all 2 processes with --resume" in line
    log = run / "process-0.stderr.log"
    assert str(log) in line and "Terminating process because" in log.read_text()  # nothing lost
    # any other failure passes through whole, with the child's status (128 + SIGABRT)
    assert _supervised(tmp_path, "other", capfd) == 128 + signal.SIGABRT
    err = capfd.readouterr().err
    assert "a warning\nnot a glog line\n" in err and "Check failed: lhs == rhs" in err and "error:" not in err


def test_supervisor_passes_sigterm_on_and_the_child_dies_with_it(tmp_path):
    for sig in (signal.SIGTERM, signal.SIGKILL):
        proc = _supervised(tmp_path, "term")
        child = int(proc.stderr.readline())  # the child is up, its handler installed
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
        if sig == signal.SIGTERM:  # passed on: the child "saves" and exits 0, and so does the supervisor
            assert proc.returncode == 0 and out == "child: SIGTERM, saved\n", (out, err)
        else:  # kill -9 of the supervisor: the child kills itself (its lifeline pipe closed)
            deadline = time.monotonic() + 10
            while _alive(child) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(child)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # a zombie is dead
    except FileNotFoundError:
        return False


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # two real processes: ~1 min alone, more under load (python -m pytest -m slow)
def test_a_dead_peer_stops_the_others_with_one_line(tmp_path):
    """2 processes x 4 CPU devices; process 1 is killed (SIGKILL) once steps are logged and a checkpoint
    saved: process 0 stops within the heartbeat timeout, with one line and exit 4, no C++ abort dump."""
    port, out = _free_port(), tmp_path / "two"
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    argv = [sys.executable, "-m", "meshdsl.models.train", *RUN, "--override", "encoder_layers=1,decoder_layers=1",
            "--steps", "1000", "--out", str(out), "--cpu-devices", "4", "--coordinator", f"127.0.0.1:{port}",
            "--num-processes", "2", "--heartbeat-timeout", "5"]
    logs = [(open(tmp_path / f"out{i}", "w+"), open(tmp_path / f"err{i}", "w+")) for i in range(2)]
    procs = [subprocess.Popen([*argv, "--process-id", str(i)], env=env, stdout=o, stderr=e)
             for i, (o, e) in enumerate(logs)]
    try:
        deadline = time.monotonic() + 240
        while (checkpoint.latest_step(str(out / "checkpoints")) or 0) < 2 and time.monotonic() < deadline:
            assert procs[0].poll() is None and procs[1].poll() is None, (tmp_path / "err0").read_text()[-3000:]
            time.sleep(0.2)
        children = _children(procs[1].pid)
        procs[1].kill()
        killed = time.monotonic()
        procs[0].wait(timeout=60)
        waited = time.monotonic() - killed
    finally:
        for p in procs:
            p.kill()
    stdout, stderr = (tmp_path / "out0").read_text(), (tmp_path / "err0").read_text()
    assert procs[0].returncode == 4, stderr[-3000:]
    assert waited < 5 + 20  # the heartbeat timeout, then at once
    errors = [line for line in stderr.splitlines() if "error" in line.lower()]
    # the heartbeat names process 1; when gloo notices first (the peer died inside a collective),
    # the line cannot name it
    assert len(errors) == 1 and (
        errors[0].startswith(f"error: process 1 of 2 stopped responding (no heartbeat for 5 s, coordinator "
                             f"127.0.0.1:{port}) after step ") or
        errors[0].startswith(f"error: a peer process of this run (2 processes, coordinator 127.0.0.1:{port}) "
                             "stopped responding after step ")), stderr
    last = checkpoint.latest_step(str(out / "checkpoints"))
    assert f"the last checkpoint is step {last} in {out / 'checkpoints'}: restart all 2 processes with --resume" \
        in errors[0]
    for text in (stdout, stderr):
        assert "Traceback" not in text and "Check fail" not in text and "Terminating process" not in text
    kept = (out / "process-0.stderr.log").read_text()
    assert "Terminating process because" in kept or "gloo" in kept  # the C++ text is kept there
    assert children and not any(map(_alive, children))  # process 1's training died with it


def _children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]
