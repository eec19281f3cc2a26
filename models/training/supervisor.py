"""Multi-process runs under a supervisor: a dead peer is one line ``error: ...``, not a C++ abort.

When a process of a multi-process run dies, jax's coordination service ends every other process
with a fatal C++ error (``Terminating process because the JAX distributed service detected fatal
errors``, then a stack dump and SIGABRT): after ``--heartbeat-timeout`` seconds without a
heartbeat from the dead process, or at once when process 0, which hosts the coordinator, is gone.
jax offers no way to handle this in Python (``jax.distributed.initialize`` passes no
``missed_heartbeat_callback`` to its client), so ``python -m meshdsl.models.train --coordinator
... --num-processes N`` (N > 1) trains in a child process, the same command marked by
``MESHDSL_TRAIN_CHILD``, and this process watches it:

* the child's stdout is this process's (the terminal); its stderr passes through here, and is kept
  whole in ``<out>/process-<I>.stderr.log`` (appended to, one header per run);
* C++ log lines (``E1123 00:05:47.182181  14689 file.cc:123] ...``) and what follows them are held
  back for :data:`HOLD_S` seconds: if the child then dies of a lost peer, they are not shown, and
  one line names the process that stopped responding, the coordinator, the timeout, the last step
  logged and the last checkpoint, and says to restart all processes with ``--resume``; the exit
  status is :data:`PEER_LOST` (4);
* SIGTERM, SIGINT and SIGHUP are passed on (the child saves at the next step boundary and exits 0,
  see :class:`~meshdsl.models.training.faults.Preemption`); the child has its own process group, so a
  Ctrl-C in the terminal reaches it once, through here; Ctrl-Z stops both;
* if this process is killed (``kill -9``), the child kills itself: it holds the read end of a pipe
  whose write end only this process holds, and reading it returns at this process's death.

Every other outcome of the child passes through unchanged: its stderr and its exit status (128 + N
for a death by signal N).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import select
import shlex
import signal
import subprocess
import sys
import threading
import time

from meshdsl.models.training.checkpoint import latest_step

__all__ = ["CHILD_ENV", "PEER_LOST", "wanted", "supervise", "watch_parent", "diagnose", "peer_lost_message"]

CHILD_ENV = "MESHDSL_TRAIN_CHILD"  # in the child: the file descriptor of its lifeline
PEER_LOST = 4
HOLD_S = 2.0       # how long C++ log lines wait before they are shown
TAIL_BYTES = 1 << 18
_GLOG = re.compile(rb"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ [^\s\]]+:\d+\] ")
#: what a process ended by the coordination service (a dead peer) writes on its way out
SIGNATURES = ("Terminating process because the JAX distributed service detected fatal errors",
              "Terminating process because the coordinator detected missing heartbeats",
              "stopped sending heartbeats", "Failed to send RPC to coordination service",
              # gloo, when the peer dies in the middle of a collective (seen under load)
              "gloo::EnforceNotMet", "Connection closed by peer", "Connection reset by peer")
_UNHEALTHY = re.compile(r"stopped sending heartbeats\):\s*(.*?)(?:\n\s*The tasks have|\n\n|$)", re.S)
_LEADER = ("leader task was preempted", "Failed to send RPC to coordination service")


def wanted(args) -> bool:
    """Whether this command line starts a supervisor: a multi-process run, not yet in the child."""
    return bool(args.coordinator) and (args.num_processes or 0) > 1 and CHILD_ENV not in os.environ


def watch_parent() -> None:
    """In the child: SIGKILL this process as soon as the supervisor is gone (no-op elsewhere)."""
    fd = os.environ.get(CHILD_ENV)
    if fd and fd.isdigit():
        threading.Thread(target=_die_with, args=(int(fd),), name="meshdsl-lifeline", daemon=True).start()


def _die_with(fd: int) -> None:
    try:
        while os.read(fd, 1):  # the supervisor never writes: this returns b"" when it has exited
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def supervise(argv: list[str], args, command=None) -> int:
    """Run ``python -m meshdsl.models.train ARGV`` (or ``command`` + ARGV) as a child; its exit status,
    or PEER_LOST."""
    out = args.out or os.path.join("runs", args.model)
    log_path = os.path.join(out, f"process-{args.process_id}.stderr.log")
    log = _open_log(log_path, argv)
    lifeline, keep = os.pipe()
    command = list(command or (sys.executable, "-m", "meshdsl.models.train"))
    child = subprocess.Popen([*command, *argv], stderr=subprocess.PIPE,
                             env={**os.environ, CHILD_ENV: str(lifeline)}, pass_fds=(lifeline,), process_group=0)
    os.close(lifeline)
    try:
        with _forwarding(child):
            tail, held = _pump(child.stderr.fileno(), log)
            code = child.wait()
    finally:
        child.stderr.close()
        if log is not None:
            with contextlib.suppress(OSError):
                log.close()
        os.close(keep)
    peer = diagnose(tail.decode("utf-8", "replace"))
    if code != 0 and peer is not None:
        print(peer_lost_message(args, peer, out, log_path if log is not None else None), file=sys.stderr, flush=True)
        return PEER_LOST
    _emit(b"".join(line for _, line in held))
    return code if code >= 0 else 128 - code


def _open_log(path: str, argv):
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        log = open(path, "ab")
    except OSError:  # the child says what is wrong with --out
        return None
    command = shlex.join(["python", "-m", "meshdsl.models.train", *argv])
    log.write(f"=== {time.strftime('%Y-%m-%d %H:%M:%S')} pid {os.getpid()}: {command}\n".encode())
    log.flush()
    return log


def _emit(data: bytes) -> None:
    if data:
        try:
            sys.stderr.flush()
            sys.stderr.buffer.write(data)
            sys.stderr.buffer.flush()
        except (OSError, ValueError):  # our stderr is gone: the log file still has it all
            pass


def _pump(fd: int, log) -> tuple[bytes, list]:
    """Copy the child's stderr to ours (C++ log lines held back) and to ``log`` until it closes;
    returns its last :data:`TAIL_BYTES` and the lines still held, as ``(arrival time, line)``."""
    tail, partial, held = bytearray(), b"", []
    while True:
        wait = max(0.0, held[0][0] + HOLD_S - time.monotonic()) if held else None
        if select.select([fd], [], [], wait)[0]:
            chunk = os.read(fd, 1 << 16)
            log = _logged(log, chunk)
            tail += chunk
            del tail[:-TAIL_BYTES]
            lines = (partial + chunk).splitlines(keepends=True)
            partial = lines.pop() if lines and chunk and not lines[-1].endswith(b"\n") else b""
            now = time.monotonic()
            for line in lines:
                if held or _GLOG.match(line):
                    held.append((now, line))
                else:
                    _emit(line)
            if not chunk:
                return bytes(tail), held
        ripe = [line for t, line in held if t + HOLD_S <= time.monotonic()]
        held = held[len(ripe):]
        _emit(b"".join(ripe))


def _logged(log, chunk: bytes):
    """Append ``chunk`` to the log; on a write error (a full disk) stop logging, never the run."""
    if log is not None and chunk:
        try:
            log.write(chunk)
            log.flush()
        except OSError:
            return None
    return log


@contextlib.contextmanager
def _forwarding(child):
    """SIGTERM/SIGINT/SIGHUP/SIGCONT go on to the child; SIGTSTP (Ctrl-Z) stops the child, then us."""
    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    def stop(signum, frame):
        forward(signal.SIGSTOP, frame)
        os.kill(os.getpid(), signal.SIGSTOP)

    handlers = {signal.SIGTERM: forward, signal.SIGINT: forward, signal.SIGHUP: forward, signal.SIGCONT: forward,
                signal.SIGTSTP: stop}
    old = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


def diagnose(stderr: str) -> dict | None:
    """A lost peer in a child's stderr: ``{"processes": [ids] or None, "leader": bool}``; else None."""
    if not any(s in stderr for s in SIGNATURES):
        return None
    found = _UNHEALTHY.search(stderr)
    if found:
        text = found.group(1)
        ids = re.findall(r"task:(\d+)", text) or re.findall(r"\b(\d+)\b", text)
        return {"processes": sorted({int(i) for i in ids}) or None, "leader": False}
    if any(s in stderr for s in _LEADER):
        return {"processes": [0], "leader": True}
    return {"processes": None, "leader": False}


def _last_logged_step(out: str) -> int | None:
    try:
        with open(os.path.join(out, "metrics.jsonl"), "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - 65536))
            lines = f.read().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None


def peer_lost_message(args, peer: dict, out: str, log_path: str | None) -> str:
    """The one line: who stopped responding, where the run is, what to do."""
    n, where = args.num_processes, args.coordinator
    ids = peer["processes"]
    if peer["leader"]:
        who = f"process 0 of {n}, the coordinator ({where}), stopped responding (its connection closed)"
    elif ids:
        names = "process " + ", ".join(map(str, ids)) if len(ids) == 1 else "processes " + ", ".join(map(str, ids))
        who = (f"{names} of {n} stopped responding (no heartbeat for {args.heartbeat_timeout} s, "
               f"coordinator {where})")
    else:
        who = f"a peer process of this run ({n} processes, coordinator {where}) stopped responding"
    step = _last_logged_step(out)
    when = f" after step {step} (the last step logged)" if step is not None else " before any step was logged"
    ckpt_dir = os.path.join(out, "checkpoints")
    last = latest_step(ckpt_dir)
    todo = (f"the last checkpoint is step {last} in {ckpt_dir}: restart all {n} processes with --resume"
            if last is not None else f"no checkpoint was saved: restart all {n} processes without --resume")
    logged = f" (process {args.process_id}'s full log: {log_path})" if log_path else ""
    return f"error: {who}{when}; {todo}{logged}"
