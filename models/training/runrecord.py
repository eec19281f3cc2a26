"""A run's record, ``run.json``: what was trained, checked again on ``--resume``, and ``--config`` files.

``run.json`` holds the CLI's options (``--attention`` among them), the resolved model config, mesh
and layout, the optimizer's resolved learning rate, warmup and (AdamW) moments and weight decay -
the model family's defaults, :mod:`meshdsl.models.training.optim` - and the data baselines. A resume must
train the same run: if the model, optimizer, schedule, batch, data or seed differ, it is refused
with the list of differences (``--allow-changes`` accepts them; they are then recorded under
``"history"`` and become the run's). Mesh, layout, ``--attention`` (how, not what, attention
computes), rematerialisation and logging may change freely: a checkpoint restores on any layout.

``--config FILE`` (YAML or JSON) gives the same keys as ``run.json`` (any subset); flags on the
command line win over the file.
"""

from __future__ import annotations

import json
import os
import time

from meshdsl.models.families.configs import config_from_dict
from meshdsl.models.training.faults import UsageError
from meshdsl.models.training.optim import ADAMW, family_of

__all__ = ["CHECKED", "DATA", "run_identity", "differences", "read_run", "write_run", "read_config_file",
           "config_file_defaults", "data_defaults"]

#: what a resume must keep (keys of :func:`run_identity`)
CHECKED = ("config", "optimizer", "optimizer_args", "lr", "warmup", "decay", "steps", "batch", "accum", "seed", "task",
           "encoder_length", "decoder_length", "text_files", "dtype", "param_dtype")
#: the options that choose a run's examples (``--eval-only`` takes them from run.json)
DATA = ("task", "batch", "encoder_length", "decoder_length", "text_files", "seed")
#: run.json keys that are not CLI options (ignored in a --config file)
RECORD_ONLY = {"config", "identity", "history", "unigram_entropy", "unigram_cross_entropy", "target_unigram_entropy",
               "config_file"}


def run_identity(args, config, lr: float, warmup: int, enc_len: int, dec_len: int) -> dict:
    """The values that define a run's trajectory (what :data:`CHECKED` compares)."""
    return {"config": {k: v for k, v in config.__dict__.items() if k != "name"}, "optimizer": args.optimizer,
            "optimizer_args": ADAMW[family_of(config)] if args.optimizer == "adamw" else {},
            "lr": float(lr), "warmup": int(warmup), "decay": args.decay, "steps": args.steps, "batch": args.batch,
            "accum": args.accum, "seed": args.seed, "task": args.task, "encoder_length": enc_len,
            "decoder_length": dec_len,
            "text_files": [os.path.abspath(p) for p in args.text_files] if args.text_files else None,
            "dtype": args.dtype, "param_dtype": args.param_dtype}


def differences(stored: dict, current: dict) -> list[str]:
    """``key: stored -> current`` for each checked value that changed (model config keys by name)."""
    out = []
    for key in CHECKED:
        if key not in stored:
            continue
        old, new = stored.get(key), current.get(key)
        if key == "config" and isinstance(old, dict) and isinstance(new, dict):
            old = _with_defaults(old)
            out += [f"model {k}: {old.get(k)!r} -> {new.get(k)!r}" for k in sorted(set(old) | set(new))
                    if k != "name" and _norm(old.get(k)) != _norm(new.get(k))]
        elif _norm(old) != _norm(new):
            out.append(f"{key}: {old!r} -> {new!r}")
    return out


def _with_defaults(config: dict) -> dict:
    """A recorded model config with the fields a newer meshdsl added (absent from an older
    run.json) at their defaults: the values the run trained with."""
    try:
        full = config_from_dict(config).__dict__
    except TypeError:   # a field this meshdsl no longer has: compared as recorded
        return config
    return {**full, **config}


def _norm(v):
    if isinstance(v, tuple):
        return [_norm(x) for x in v]
    if isinstance(v, list):
        return [_norm(x) for x in v]
    return v


def read_run(out: str) -> dict | None:
    path = os.path.join(out, "run.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path} is unreadable ({e}): restore it, or pass --allow-changes to resume "
                         "without checking the run") from e


def write_run(out: str, record: dict) -> None:
    """Write ``run.json`` atomically."""
    path = os.path.join(out, "run.json")
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1, default=str)
    os.replace(tmp, path)


def history_entry(step: int, changes: list[str]) -> dict:
    return {"resumed_at_step": step, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "changes": changes}


def read_config_file(path: str) -> dict:
    """A YAML (``.yaml``/``.yml``) or JSON file of run.json keys -> dict."""
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise UsageError(f"--config {path}: cannot be read ({e.strerror or e})") from e
    try:
        if path.endswith((".yaml", ".yml")):
            import yaml
            values = yaml.safe_load(text)
        else:
            values = json.loads(text)
    except Exception as e:  # noqa: BLE001 - yaml / json syntax errors
        raise UsageError(f"--config {path}: not valid {'YAML' if path.endswith(('.yaml', '.yml')) else 'JSON'} "
                         f"({str(e).splitlines()[0]})") from e
    if not isinstance(values, dict):
        raise UsageError(f"--config {path}: must hold a mapping of option names to values")
    return values


def config_file_defaults(path: str, parser) -> dict:
    """Parser defaults from a config file; unknown keys are an error listing the known ones."""
    values = read_config_file(path)
    dests = {a.dest for a in parser._actions}
    out = {}
    for key, value in values.items():
        dest = key.replace("-", "_")
        if dest in RECORD_ONLY or dest in ("resume", "resume_from", "overwrite", "allow_changes", "eval_only", "help",
                                           "debug_nan_at_step", "debug_signal"):
            continue
        if dest not in dests:
            raise UsageError(f"--config {path}: unknown key {key!r}; known keys: "
                             f"{', '.join(sorted(d for d in dests if d != 'help'))}")
        out[dest] = value
    if "config" in values and isinstance(values["config"], dict) and "override" not in values:
        model = values["config"]
        out["override"] = [",".join(f"{k}={v!r}" for k, v in model.items() if k not in ("name", "vocab"))]
    return out


def data_defaults(out: str) -> dict:
    """The :data:`DATA` options of the run in ``out`` (its run.json; {} if there is none), as parser
    defaults: what ``--eval-only`` evaluates on unless the command line says otherwise. The values are
    the resolved ones (``text_files`` absolute, the lengths filled in)."""
    stored = read_run(out) or {}
    identity = stored.get("identity", {})
    values = {key: identity.get(key, stored.get(key)) for key in DATA if key in identity or key in stored}
    if values.get("task") == "lm":   # its encoder (T5's; Llama has none) sees one token: not an option's value
        values.pop("encoder_length", None)
    return values
