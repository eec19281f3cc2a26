"""What a training run shows and writes: a progress bar, ``metrics.jsonl`` and ``loss.png``.

* :class:`MetricsLog` appends one JSON object per logged step (and, with ``tensorboard_dir`` and
  tensorboardX installed, the same scalars as TensorBoard event files) (``step``, ``loss``, ``lr``,
  ``tokens_per_s``, ``step_time_s``, ..., ``val_loss`` when evaluated, MoE router statistics).
  Opened to resume at step ``k``, it first drops the records after ``k``, so a resumed run's file
  equals an uninterrupted run's.
* :func:`plot_losses` draws the train and validation loss curves (matplotlib, Agg backend).
* :class:`ProgressBar` is a rich progress bar with loss, tokens/s and ETA; when stdout is not a
  terminal it prints one plain line per logged step instead.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import numpy as np

__all__ = ["MetricsLog", "plot_losses", "ProgressBar", "jsonable"]


def jsonable(value):
    """numpy scalars and arrays -> JSON numbers and lists (NaN/inf as null)."""
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    arr = np.asarray(value)
    if arr.ndim:
        return [jsonable(v) for v in arr.tolist()]
    v = arr.item()
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class MetricsLog:
    """``metrics.jsonl``: one object per logged step; ``resume_step`` keeps only steps <= it."""

    def __init__(self, path: str, resume_step: int | None = None, enabled: bool = True,
                 tensorboard_dir: str | None = None):
        self.path, self.enabled = path, enabled
        self._tb = None
        if not enabled:
            return
        if tensorboard_dir:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:  # JSONL only
                pass
            else:
                self._tb = SummaryWriter(tensorboard_dir, purge_step=resume_step + 1 if resume_step else None)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        kept = []
        if resume_step is not None and os.path.exists(path):
            kept = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
        with open(path, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in kept)

    def write(self, record: dict) -> None:
        if self.enabled:
            with open(self.path, "a") as f:
                f.write(json.dumps(jsonable(record)) + "\n")
            if self._tb is not None:
                step = int(record["step"])
                for key, value in jsonable(record).items():
                    if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                        self._tb.add_scalar(_tb_tag(key), value, step)
                self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _tb_tag(key: str) -> str:
    """TensorBoard tags grouped by kind: ``train/loss``, ``val/loss``, ``moe/...``, ``perf/tokens_per_s``."""
    if "/" in key:
        return key
    if key.startswith("val_"):
        return f"val/{key[4:]}"
    if key in ("step_time_s", "tokens_per_s"):
        return f"perf/{key}"
    return f"train/{key}"


def read_metrics(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_losses(metrics_path: str, out_path: str, baseline: float | None = None, title: str = "") -> bool:
    """Train loss (and validation loss, when present) against step, as a PNG; False without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train loss", lw=1.2)
    if val:
        ax.plot(*zip(*val), "o-", label="validation loss", lw=1.5)
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1,
                   label=f"unigram entropy of the validation targets {baseline:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_path)
    plt.close(fig)
    return True


class ProgressBar:
    """Steps done, loss, tokens/s and ETA; a rich bar on a terminal, plain lines otherwise."""

    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.total, self.done, self.enabled = total, start, enabled
        self._t0, self._s0 = time.perf_counter(), start
        self._bar = None
        if enabled and sys.stdout.isatty():
            try:
                from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                                           TimeRemainingColumn)
            except ImportError:  # plain lines
                return
            self._bar = Progress(TextColumn("[bold]train"), BarColumn(bar_width=16), MofNCompleteColumn(),
                                 TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(compact=True),
                                 TextColumn("{task.fields[info]}"))
            self._task = self._bar.add_task("train", total=total, completed=start, info="")
            self._bar.start()

    def advance(self, n: int = 1) -> None:
        self.done += n
        if self._bar is not None:
            self._bar.update(self._task, advance=n)

    def log(self, record: dict) -> None:
        info = _line(record)
        if self._bar is not None:
            self._bar.update(self._task, info=_line(record, compact=True))
            if "val_loss" in record:
                self._bar.console.print(f"step {record['step']}: {info}")
        elif self.enabled:
            elapsed = time.perf_counter() - self._t0
            rate = (self.done - self._s0) / elapsed if elapsed > 0 else 0.0
            eta = (self.total - self.done) / rate if rate > 0 else float("nan")
            print(f"step {record['step']:>6}/{self.total}  {info}  ETA {_clock(eta)}", flush=True)

    def print(self, text: str) -> None:
        if self._bar is not None:
            self._bar.console.print(text)
        elif self.enabled:
            print(text, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()


def _line(r: dict, compact: bool = False) -> str:
    parts = [f"loss {r['loss']:.3f}"] if r.get("loss") is not None else []
    if r.get("val_loss") is not None:
        parts.append(f"val {r['val_loss']:.3f}")
    if r.get("tokens_per_s"):
        parts.append(f"{r['tokens_per_s']:,.0f} tok/s")
    if compact:
        return " ".join(parts)
    if r.get("step_time_s"):
        parts.append(f"{r['step_time_s'] * 1e3:.0f} ms/step")
    if r.get("lr") is not None:
        parts.append(f"lr {r['lr']:.2e}")
    return "  ".join(parts)


def _clock(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "--:--"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"
