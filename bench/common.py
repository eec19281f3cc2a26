"""Shared benchmark plumbing: device setup, measuring one program three ways, writing results.

Every benchmark writes ``bench/results/<name>.json`` (machine, versions, date, rows) and
``bench/results/<name>.md`` (a markdown table). Importing this module sets up 8 virtual CPU
devices unless the process already has more than one device.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import sys
import time

if "jax" not in sys.modules:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import jax  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.costmodel import hlo_comm  # noqa: E402
from meshdsl.names.units import fmt_bytes  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def machine() -> dict:
    dev = jax.devices()[0]
    return {
        "date": datetime.datetime.now().strftime("%Y-%m-%d"),
        "platform": dev.platform, "device_kind": dev.device_kind, "devices": len(jax.devices()),
        "cpu_count": os.cpu_count(), "python": platform.python_version(), "jax": jax.__version__,
        "machine": platform.machine(),
    }


def hlo_bytes(f, *args) -> dict:
    """kind -> {"count", "bytes"} moved per device in the compiled program."""
    rep = hlo_comm.analyze(f.lower(*args).compile())
    return {k: {"count": v["count"], "bytes": v["moved_bytes"]} for k, v in rep.summary().items()}


def measure(fn, mesh, layout, *args, **lower_kw) -> dict:
    """The explicit backend's compiled bytes, its md.explain prediction, and the gspmd backend's."""
    explicit = hlo_bytes(md.lower(fn, mesh, layout, **lower_kw), *args)
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]}
                 for k, v in md.explain(fn, mesh, layout, *args, **lower_kw).summary().items()}
    gspmd = hlo_bytes(md.lower(fn, mesh, layout, backend="gspmd"), *args)
    return {"explicit": explicit, "explain": predicted, "gspmd": gspmd}


def total(by_kind: dict) -> float:
    return float(sum(v["bytes"] for v in by_kind.values()))


def fmt_kinds(by_kind: dict) -> str:
    return ", ".join(f"{k} {v['count']}x {fmt_bytes(v['bytes'])}" for k, v in by_kind.items()) or "none"


def same_bytes(a: dict, b: dict) -> bool:
    """Two per-kind summaries move the same bytes of each kind."""
    return {k: v["bytes"] for k, v in a.items()} == {k: v["bytes"] for k, v in b.items()}


def ratio(a: float, b: float) -> str:
    if b == 0:
        return "1.00" if a == 0 else "inf"
    return f"{a / b:.2f}"


def median_time(f, args, reps: int) -> float:
    """The median wall time of ``reps`` runs of ``f(*args)`` (seconds; warm it up first)."""
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def alternate(fns: dict, args, pairs: int, warmup: int = 2) -> dict:
    """Run compiled callables ``fns`` (name -> f) on ``args`` alternately, A B A B ... ``pairs``
    times after ``warmup`` runs of each, so that drifts in machine load hit all alike: name ->
    list of wall times (seconds)."""
    def timed(f):
        t = time.perf_counter()
        jax.block_until_ready(f(*args))
        return time.perf_counter() - t
    for f in fns.values():
        for _ in range(warmup):
            timed(f)
    times = {k: [] for k in fns}
    for _ in range(pairs):
        for k, f in fns.items():
            times[k].append(timed(f))
    return times


def table(rows: list, columns: list) -> list:
    """Markdown table lines: one column per ``(heading, row -> cell)``, one line per row."""
    lines = ["| " + " | ".join(c for c, _ in columns) + " |", "|" + " --- |" * len(columns)]
    return lines + ["| " + " | ".join(str(get(row)) for _, get in columns) + " |" for row in rows]


def write(name: str, rows: list, columns: list, title: str, notes: str = "", extra: dict | None = None,
          out: str | None = None, tables: tuple = ()) -> str:
    """Write ``<name>.json`` (``extra`` merged in) and ``<name>.md`` into ``out`` (default
    bench/results); ``tables``: more ``(heading, rows, columns)`` after the first table (their rows
    go in the JSON through ``extra``). Returns the markdown."""
    out = out or RESULTS
    os.makedirs(out, exist_ok=True)
    info = machine()
    with open(os.path.join(out, f"{name}.json"), "w") as fh:
        json.dump({"machine": info, "rows": rows, **(extra or {})}, fh, indent=2)
    lines = [f"### {title}", "",
             f"{info['date']}, jax {info['jax']}, {info['devices']} x {info['device_kind']} ({info['platform']}), "
             f"{info['cpu_count']} host cores", ""]
    if notes:
        lines += [notes, ""]
    lines += table(rows, columns)
    for heading, more_rows, more_columns in tables:
        lines += ["", heading, "", *table(more_rows, more_columns)]
    text = "\n".join(lines) + "\n"
    with open(os.path.join(out, f"{name}.md"), "w") as fh:
        fh.write(text)
    return text
