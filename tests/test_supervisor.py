"""Multi-process training runs (models/training/supervisor.py): a dead peer is one line. The supervisor is
tested on a stand-in child (a lost peer's C++ abort becomes one line, other failures pass through,
SIGTERM is passed on, the child dies with a killed supervisor), then two real processes x 4 CPU
devices lose process 1 to SIGKILL. The single-process faults: test_train_faults.py.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from helpers import RUN
from meshdsl.models.train import parse_args
from meshdsl.models.training import checkpoint, supervisor


# -- multi-process runs: a dead peer is one line (models/training/supervisor.py) ---------------------

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
    from meshdsl.models.training.supervisor import watch_parent
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
    script = ("import sys; from meshdsl.models.training import supervisor; "
              "from meshdsl.models.train import parse_args; "
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
