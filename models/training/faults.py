"""What a training run does when something goes wrong: the user's mistakes, divergence, preemption.

* :class:`UsageError` - a mistake the user can fix (a bad flag, an unwritable ``--out``, a text file
  that is not text): the CLI prints one line ``error: ...`` saying what to change, and exits 2.
* :class:`Diverged` - the loss or gradient norm of a step is NaN/inf: the run stops before saving
  that state, names the step and the last good checkpoint, and exits 3.
* :class:`Preemption` - SIGTERM or SIGINT (Ctrl-C) asks the loop to save at the next step boundary
  and exit 0; a second Ctrl-C quits at once (KeyboardInterrupt, exit 130, nothing saved).
* checks that run before any data is loaded or anything compiles: :func:`check_out_dir`,
  :func:`check_text_files`, :func:`checked_vocabulary`, :func:`mesh_warnings`, :func:`check_schedule`.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import threading

from meshdsl.ops.pipeline import SCHEDULES
from meshdsl.names.units import fmt_bytes

__all__ = ["UsageError", "Diverged", "ExchangeOverflow", "Preemption", "check_out_dir", "check_free_space", "check_text_files",
           "checked_vocabulary", "mesh_warnings", "check_schedule"]

#: pipeline schedules named in the literature that meshdsl does not lower (yet); none since circular landed
PLANNED_SCHEDULES: tuple[str, ...] = ()


class UsageError(SystemExit):
    """A mistake in how the run was asked for; ``str(e)`` says what to change. Exit status 2."""

    def __init__(self, message: str):
        super().__init__(message)
        self.code = 2


class Diverged(SystemExit):
    """A step's loss or gradient norm is not finite; its state was not saved. Exit status 3."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.code, self.step = 3, step


class ExchangeOverflow(SystemExit):
    """A step of a dropless mixture-of-experts model with a stated exchange bound
    (``exchange_factor``) sent some device more token assignments than the bound holds; they were
    counted, not silently dropped, and the step's state was not saved. Exit status 3."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.code, self.step = 3, step


class Preemption:
    """``with Preemption() as stop:`` - SIGTERM/SIGINT set ``stop.requested`` (the signal's name)
    instead of killing the process; the loop saves at the next step boundary. A second SIGINT raises
    KeyboardInterrupt at once. Handlers are installed only from the main thread, restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, notify=None):
        self.requested: str | None = None
        self._old = {}
        self._notify = notify or (lambda text: print(text, file=sys.stderr, flush=True))

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self.handle)
        return self

    def __exit__(self, *exc):
        for sig, old in self._old.items():
            signal.signal(sig, old)
        self._old.clear()
        return False

    def handle(self, signum, frame=None) -> None:
        name = signal.Signals(signum).name
        if self.requested is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.requested is None:
            self.requested = name
            self._notify(f"{name}: saving a checkpoint after this step, then exiting "
                         "(Ctrl-C again to quit at once without saving)")


def check_out_dir(out: str) -> None:
    """``--out`` must be a directory this process can create files in (before anything is loaded)."""
    try:
        os.makedirs(out, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write-test-"):
            pass
    except OSError as e:
        raise UsageError(f"--out {out} is not a writable directory ({e.strerror or e}): choose another --out") from e


def check_free_space(out: str, checkpoint_bytes: int, keep: int | None) -> str | None:
    """UsageError if ``out``'s disk cannot hold one checkpoint; a warning if not ``keep + 1`` of them
    (orbax writes the new checkpoint before it deletes the oldest)."""
    free = shutil.disk_usage(out).free
    if free < checkpoint_bytes:
        raise UsageError(f"--out {out}: a checkpoint needs about {fmt_bytes(checkpoint_bytes)} but only "
                         f"{fmt_bytes(free)} is free there: free space or choose another --out")
    copies = (keep or 1) + 1
    if free < checkpoint_bytes * copies:
        return (f"warning: {fmt_bytes(free)} free under {out}: not enough for {copies} checkpoints of "
                f"{fmt_bytes(checkpoint_bytes)} (--keep {keep} + the one being written)")
    return None


def check_text_files(paths) -> None:
    """Each ``--text-files`` entry is a readable, non-empty UTF-8 text file (the error names the file)."""
    total = 0
    for path in paths or ():
        if not os.path.exists(path):
            raise UsageError(f"--text-files {path}: no such file")
        if os.path.isdir(path):
            raise UsageError(f"--text-files {path}: is a directory; list the text files in it")
        try:
            with open(path, "rb") as f:
                data = f.read()
        except OSError as e:
            raise UsageError(f"--text-files {path}: cannot be read ({e.strerror or e})") from e
        nul = data.find(b"\0")
        if nul >= 0:
            raise UsageError(f"--text-files {path}: is a binary file (NUL byte at offset {nul}), "
                             "not UTF-8 text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--text-files {path}: is not UTF-8 text (invalid byte at offset {e.start}); "
                             "convert it, e.g. iconv -t utf-8") from e
        lines = sum(1 for line in text.splitlines() if line.strip())
        if not lines:
            raise UsageError(f"--text-files {path}: is empty (one document per non-blank line)")
        total += lines
    if paths and total < 2:
        raise UsageError(f"--text-files {' '.join(map(str, paths))}: {total} document in all; "
                         "training needs at least a few (one document per non-blank line)")


def checked_vocabulary(text_files):
    """``corpus.load_vocabulary``, with a cache file that cannot be read named (delete it)."""
    from meshdsl.models.data import corpus

    try:
        return corpus.load_vocabulary(text_files)
    except Exception as e:  # noqa: BLE001 - sentencepiece's errors name no file
        documents = corpus.load_documents("train", text_files)
        if not documents:
            raise UsageError(f"--text-files {' '.join(map(str, text_files or []))}: no training documents "
                             "(every document fell in the validation split); give more text") from e
        path = corpus.cache_dir() / "vocab" / (f"unigram-{corpus.VOCAB_SIZE}-"
                                               f"{corpus.corpus_digest(documents)[:16]}.model")
        if path.exists():
            raise UsageError(f"the vocabulary cache {path} is unreadable ({type(e).__name__}: "
                             f"{str(e).splitlines()[0] if str(e) else ''}): delete it and run again") from e
        raise


def check_schedule(name: str, repeats: int = 1) -> None:
    """``--schedule`` (and ``--repeats``): one of the pipeline schedules md.lower implements, else a
    UsageError naming them; ``--repeats`` above 1 (chunks per stage) only with ``circular``."""
    if name not in SCHEDULES:
        known = ", ".join(SCHEDULES)
        why = "is not implemented yet" if name in PLANNED_SCHEDULES else "is not a pipeline schedule"
        planned = f" ({', '.join(PLANNED_SCHEDULES)}: planned, not implemented)" if PLANNED_SCHEDULES else ""
        raise UsageError(f"--schedule {name}: {why}; the schedules that exist: {known}{planned}")
    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: must be >= 1 (chunks of the stack per pipeline stage)")
    if repeats > 1 and name != "circular":
        raise UsageError(f"--repeats {repeats} is the circular schedule's (chunks of the stack per pipeline stage), "
                         f"not {name}'s: pass --schedule circular, or leave out --repeats")


def mesh_warnings(mesh, layout) -> list[str]:
    """Mesh axes (size > 1) that no compute rule of ``layout`` uses: the work is replicated there."""
    used = {a for axes in layout.rules.values() for a in axes}
    stored = {a for axes in layout.param_rules.values() for a in axes}
    out = []
    for axis, size in mesh.shape.items():
        if size > 1 and axis not in used:
            only = " (only parameter storage is split over it)" if axis in stored else ""
            out.append(f"warning: no layout rule maps a dim to mesh axis {axis!r} (size {size}): compute is "
                       f"replicated {size}x over {axis!r}{only}; add a rule such as heads:{axis};d_ff:{axis}")
    return out
