"""Layout-independent checkpoints with orbax, verified by a checksum manifest.

A checkpoint holds *global* values: every NamedArray is saved whole (orbax writes each device's
shards), with its dims in the tree. Restoring takes the tree of what to restore (concrete or
abstract, e.g. from ``jax.eval_shape``), a mesh and a layout, and places every NamedArray as that
layout says (parameters by its storage rules) - so a run saved on ``data:8`` resumes on
``data:2,model:4`` with a Megatron layout, or on one device.

    ckpts = Checkpoints(directory, keep=3)             # one long-lived orbax CheckpointManager
    ckpts.save(step, state)                            # async; returns while orbax writes
    ckpts.restore(like, mesh, layout, step=None)       # the latest intact step by default
    ckpts.close()                                      # waits for the last save
    save(directory, step, state) / restore(directory, like, mesh, layout, step=None)   # one-shot
    shardings(tree, mesh, layout)                      # where each leaf of a state lives

Every save is followed (in orbax's post-finalization callback, so only once the step directory is
complete) by ``manifest.sha256.json`` in the step directory: the SHA-256 of every file orbax wrote.
``restore`` checks it first; a changed or missing file raises :class:`CheckpointError` naming the
step, the file, and the newest intact step to resume from instead. It then compares the step's
shapes with ``like``'s (orbax's metadata): a model or optimizer of other shapes (``--resume
--allow-changes --override d_model=...``) names the first parameter that does not fit, with both
shapes, rather than reading as damage. Numbered directories without
orbax's ``_CHECKPOINT_METADATA`` (an interrupted save, an empty directory) are not checkpoints and
are ignored; orbax's temporary directories of interrupted saves are swept when a manager opens.

Optimizer states mirror the parameters' tree, so optax leaves NamedArrays whose array is not the
parameter's shape (Adafactor's factored moments drop one dim; unused slots are ``(1,)``). Such a
leaf is placed by the dims its shape still matches (the parameter's dims minus the dropped one),
else replicated; every other non-NamedArray leaf (step counters, RNG keys) is replicated.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import threading

import jax
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from meshdsl.names.named import NamedArray, is_named
from meshdsl.platform.jaxcompat import HOST_MEMORY
from meshdsl.names.units import fmt_bytes

__all__ = ["Checkpoints", "CheckpointError", "save", "restore", "latest_step", "abstract_like", "shardings",
           "offloaded", "MANIFEST", "state_bytes"]

MANIFEST = "manifest.sha256.json"
_COMPLETE = "_CHECKPOINT_METADATA"  # orbax writes it when a step is finalized
_MUTABLE = {MANIFEST, _COMPLETE, "commit_success.txt"}  # orbax rewrites its step metadata after the manifest


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read back as saved; the message says what to do."""


def state_bytes(tree) -> int:
    """Bytes of the arrays of ``tree`` (concrete or abstract): about what one checkpoint takes."""
    total = 0
    for x in jax.tree_util.tree_leaves(tree, is_leaf=is_named):
        arr = x._array if is_named(x) else x
        if hasattr(arr, "shape") and hasattr(arr, "dtype"):
            n = 1
            for s in arr.shape:
                n *= int(s)
            total += n * getattr(arr.dtype, "itemsize", 4)
    return total


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(step_dir: str) -> list[str]:
    out = []
    for root, _, names in os.walk(step_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), step_dir)
            if rel not in _MUTABLE:
                out.append(rel)
    return sorted(out)


def write_manifest(step_dir: str, step: int) -> None:
    """``manifest.sha256.json`` of a finished step directory (written atomically)."""
    files = {rel: _sha256(os.path.join(step_dir, rel)) for rel in _files(step_dir)}
    tmp = os.path.join(step_dir, f".{MANIFEST}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump({"step": int(step), "files": files}, f, indent=0)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(step_dir, MANIFEST))


def check_step(step_dir: str) -> str | None:
    """None if ``step_dir`` matches its manifest; else what is wrong (naming the file)."""
    path = os.path.join(step_dir, MANIFEST)
    if not os.path.exists(path):
        return f"it has no {MANIFEST} (the run stopped before the save finished)"
    try:
        with open(path) as f:
            files = json.load(f)["files"]
    except (OSError, ValueError, KeyError) as e:
        return f"its {MANIFEST} is unreadable ({e})"
    for rel, digest in files.items():
        full = os.path.join(step_dir, rel)
        if not os.path.exists(full):
            return f"file {full} is missing"
        if _sha256(full) != digest:
            return f"file {full} has changed since it was saved (SHA-256 mismatch)"
    return None


def _spec(x: NamedArray, mesh, layout) -> PartitionSpec:
    """The layout's spec for ``x``; for a reduced optimizer statistic, that of the dims it kept."""
    shape = tuple(x.raw.shape)
    if shape == x.dims.sizes:
        return layout.spec(x.dims, mesh, storage=x.is_param)
    if len(shape) == len(x.dims) - 1:
        for k in range(len(x.dims)):
            kept = [d for i, d in enumerate(x.dims) if i != k]
            if tuple(d.size for d in kept) == shape:
                return layout.spec(kept, mesh, storage=x.is_param)
    return PartitionSpec()


def shardings(tree, mesh, layout):
    """``tree`` with each array replaced by the ``NamedSharding`` that ``layout`` gives it on ``mesh``
    (NamedArray nodes kept, so the result matches ``tree`` for ``jax.jit``'s in/out_shardings);
    a train state's optimizer state in host memory where the layout offloads it."""
    def leaf(path, x):
        sharding = _sharding(path, x, mesh, layout)
        return NamedArray(sharding, x.dims, is_param=x.is_param) if is_named(x) else sharding
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_named)


def abstract_like(tree, mesh, layout):
    """``tree`` as ShapeDtypeStructs carrying the shardings ``layout`` gives on ``mesh``."""
    def leaf(path, x):
        arr = x.raw if is_named(x) else x
        struct = jax.ShapeDtypeStruct(arr.shape, arr.dtype, sharding=_sharding(path, x, mesh, layout))
        return NamedArray(struct, x.dims, is_param=x.is_param) if is_named(x) else struct
    return jax.tree_util.tree_map_with_path(leaf, tree, is_leaf=is_named)


def offloaded(path, layout) -> bool:
    """Does the leaf at ``path`` of a train state live in host memory (``md.Layout(...,
    offload="optimizer")`` puts the optimizer state there, ``offload="params"`` the parameters)?"""
    part = _keys(path[:1]) if path else ()
    return ("optimizer" in layout.offload and part == ("opt_state",)) or \
        ("params" in layout.offload and part == ("params",))


def _sharding(path, x, mesh, layout) -> NamedSharding:
    sharding = NamedSharding(mesh.jax_mesh, _spec(x, mesh, layout) if is_named(x) else PartitionSpec())
    return sharding.with_memory_kind(HOST_MEMORY) if offloaded(path, layout) else sharding


def _keys(path) -> tuple[str, ...]:
    """A tree path as plain strings: the same for a state and for orbax's metadata of it."""
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def _numbered(directory: str) -> list[int]:
    if not os.path.isdir(directory):
        return []
    return sorted(int(n) for n in os.listdir(directory) if n.isdigit() and os.path.isdir(os.path.join(directory, n)))


def complete_steps(directory: str) -> list[int]:
    """Steps under ``directory`` that orbax finished writing (ascending)."""
    return [s for s in _numbered(directory) if os.path.exists(os.path.join(directory, str(s), _COMPLETE))]


def latest_step(directory: str) -> int | None:
    """The newest complete checkpoint's step under ``directory`` (None: none)."""
    steps = complete_steps(directory)
    return steps[-1] if steps else None


class Checkpoints:
    """The checkpoints of one run: one orbax ``CheckpointManager`` kept open for the whole run.

    ``save`` is asynchronous (orbax copies the arrays to host memory, then writes in a background
    thread; the next save or ``wait``/``close`` waits for it). ``keep``: how many of the newest
    steps orbax keeps (None: all). ``lead``: whether this process writes manifests and sweeps
    (process 0 of a multi-process run; every process calls ``save`` and ``restore``).
    ``writable=False`` opens read-only (nothing swept, created or deleted)."""

    def __init__(self, directory: str, *, keep: int | None = 3, lead: bool = True, writable: bool = True):
        self.directory = os.path.abspath(directory)
        self.lead, self.writable = lead, writable
        self.notes: list[str] = []  # what opening / restoring found, for the run's log
        self._lock = threading.Lock()
        self._pending: int | None = None
        self._callback_error: BaseException | None = None
        self._bytes = 0
        if writable and lead:
            for s in _numbered(self.directory):
                path = os.path.join(self.directory, str(s))
                if not os.path.exists(os.path.join(path, _COMPLETE)):
                    shutil.rmtree(path, ignore_errors=True)
                    self.notes.append(f"removed {path}: an unfinished save (no {_COMPLETE})")
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep, create=writable, read_only=not writable, cleanup_tmp_directories=writable,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._finalized))
        self._mgr = ocp.CheckpointManager(self.directory, options=options)

    # -- writing ---------------------------------------------------------------------------------

    def _finalized(self) -> None:
        """orbax's post-finalization callback: the pending step is complete on disk."""
        with self._lock:
            step, self._pending = self._pending, None
        if step is None or not self.lead:
            return
        try:  # orbax renames the temporary directory to the step's right after this callback
            tmp = [n for n in os.listdir(self.directory) if n.startswith(f"{step}.orbax-checkpoint-tmp")]
            write_manifest(os.path.join(self.directory, tmp[0] if len(tmp) == 1 else str(step)), step)
        except BaseException as e:  # noqa: BLE001 - reported by the next save / wait
            self._callback_error = e

    def save(self, step: int, state) -> None:
        """Start saving ``state`` as ``step`` (a step saved before, e.g. by a run restarted from an
        earlier step, is replaced). Raises :class:`CheckpointError` if this or the previous save failed."""
        step = int(step)
        try:
            self._mgr.wait_until_finished()
            self._raise_callback_error()
            if step in self._mgr.all_steps():
                self._mgr.delete(step)
            self._bytes = state_bytes(state)
            with self._lock:
                self._pending = step
            self._mgr.save(step, args=ocp.args.StandardSave(state), force=True)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - orbax / OS errors, told in the user's terms
            raise self._save_error(step, e) from e

    def _raise_callback_error(self) -> None:
        if self._callback_error is not None:
            e, self._callback_error = self._callback_error, None
            raise CheckpointError(f"writing the checksum manifest under {self.directory} failed: {e}")

    def _save_error(self, step: int, e: BaseException) -> CheckpointError:
        step = self._pending if self._pending is not None else step
        try:
            free = fmt_bytes(shutil.disk_usage(self.directory).free)
        except OSError:
            free = "unknown"
        return CheckpointError(
            f"saving checkpoint step {step} to {self.directory} failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}. A checkpoint needs about {fmt_bytes(self._bytes)}; "
            f"{free} is free there. Free space or choose another --out (or fewer --keep)")

    def wait(self) -> None:
        """Block until the last save is on disk with its manifest."""
        try:
            self._mgr.wait_until_finished()
        except Exception as e:  # noqa: BLE001
            raise self._save_error(self._pending or 0, e) from e
        self._raise_callback_error()
        with self._lock:
            step, self._pending = self._pending, None
        if step is not None and self.lead and os.path.isdir(os.path.join(self.directory, str(step))):
            write_manifest(os.path.join(self.directory, str(step)), step)  # the callback did not run

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._mgr.close()

    def discard_after(self, step: int) -> list[str]:
        """Move steps newer than ``step`` out of the way (to ``<directory>.superseded/``), so a run
        resumed from ``step`` neither restores nor rotates them; returns where they went."""
        moved = []
        if self.lead:
            for s in _numbered(self.directory):
                if s > step:
                    dest = os.path.join(f"{self.directory}.superseded", str(s))
                    if os.path.exists(dest):
                        shutil.rmtree(dest)
                    os.makedirs(os.path.dirname(dest), exist_ok=True)
                    shutil.move(os.path.join(self.directory, str(s)), dest)
                    moved.append(dest)
        self._mgr.reload()
        return moved

    # -- reading ---------------------------------------------------------------------------------

    def steps(self) -> list[int]:
        return complete_steps(self.directory)

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def latest_intact_step(self, below: int | None = None) -> int | None:
        """The newest step whose files match their manifest (below ``below`` if given)."""
        for s in reversed(self.steps()):
            if (below is None or s < below) and check_step(os.path.join(self.directory, str(s))) is None:
                return s
        return None

    def _damaged(self, step: int, problem: str) -> CheckpointError:
        intact = self.latest_intact_step(below=step)
        then = (f"The newest intact checkpoint is step {intact}: resume from it with --resume-from {intact}"
                if intact is not None else "No older intact checkpoint is left: start over with --overwrite")
        return CheckpointError(f"checkpoint step {step} in {self.directory} is damaged: {problem}. {then}")

    def verify(self, step: int) -> None:
        """Raise :class:`CheckpointError` unless step ``step`` matches its manifest (a step saved
        without one, e.g. by an older version, passes with a note)."""
        problem = check_step(os.path.join(self.directory, str(step)))
        if problem is None:
            return
        if problem.startswith("it has no"):
            self.notes.append(f"checkpoint step {step} has no {MANIFEST}: restored without verifying it")
            return
        raise self._damaged(step, problem)

    def misfit(self, step: int, like) -> str | None:
        """The first parameter (then other state) of ``like`` whose shape differs from step ``step``'s,
        or that the step lacks, in words; None if all fit (or the step's metadata is unreadable)."""
        try:
            meta = ocp.StandardCheckpointHandler().metadata(pathlib.Path(self.directory, str(step), "default"))
        except Exception:  # noqa: BLE001 - then orbax's restore reports what is wrong
            return None
        stored = {_keys(p): tuple(m.shape) for p, m in jax.tree_util.tree_flatten_with_path(meta)[0]
                  if hasattr(m, "shape")}
        wanted = [(_keys(p), tuple(x.shape)) for p, x in jax.tree_util.tree_flatten_with_path(like)[0]
                  if hasattr(x, "shape")]
        for keys, shape in sorted(wanted, key=lambda item: item[0][:1] != ("params",)):
            name = "/".join(k for k in keys if k not in ("value", "array"))
            if keys not in stored:
                return f"it has no {name} (shape {shape} here)"
            if stored[keys] != shape:
                return f"{name} is {stored[keys]} there but {shape} here"
        return None

    def restore(self, like, mesh, layout, step: int | None = None):
        """Restore ``step`` (default: the latest) shaped like ``like``, placed by ``layout`` on ``mesh``,
        after checking its files against the manifest."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"no checkpoint under {self.directory}")
        if step is None:
            step = steps[-1]
        elif int(step) not in steps:
            raise CheckpointError(f"no checkpoint for step {step} under {self.directory}; it holds steps "
                                  f"{', '.join(map(str, steps))}")
        step = int(step)
        self.verify(step)
        misfit = self.misfit(step, like)
        if misfit:  # before orbax starts reading (its error would read as a damaged checkpoint)
            raise CheckpointError(f"checkpoint step {step} in {self.directory} does not fit this run's shapes: "
                                  f"{misfit}. --allow-changes cannot change the shapes of the parameters or of "
                                  "the optimizer state: resume with the run's --model/--override/--optimizer, or "
                                  "start a new run (another --out, or --overwrite)")
        try:
            return self._mgr.restore(step, args=ocp.args.StandardRestore(abstract_like(like, mesh, layout)))
        except Exception as e:  # noqa: BLE001 - orbax's errors, in the user's terms
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise self._damaged(step, f"orbax could not read it back ({type(e).__name__}: {first[:300]})") from e


def save(directory: str, step: int, state, *, max_to_keep: int | None = 3) -> None:
    """Save ``state`` as step ``step`` under ``directory`` (blocking until written, manifest included;
    every process of a multi-process run calls it, each writing its own shards)."""
    ckpts = Checkpoints(directory, keep=max_to_keep, lead=jax.process_index() == 0)
    try:
        ckpts.save(step, state)
    finally:
        ckpts.close()


def restore(directory: str, like, mesh, layout, step: int | None = None):
    """Restore ``step`` (default: the latest) shaped like ``like``, placed by ``layout`` on ``mesh``."""
    if not os.path.isdir(directory):
        raise CheckpointError(f"no checkpoint under {directory}")
    ckpts = Checkpoints(directory, writable=False)
    try:
        return ckpts.restore(like, mesh, layout, step)
    finally:
        ckpts.close()
