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
from meshdsl import hlo_comm  # noqa: E402
from meshdsl.units import fmt_bytes  # noqa: E402

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


def write(name: str, rows: list, columns: list, title: str, notes: str = "", extra: dict | None = None) -> str:
    """Write ``<name>.json`` (``extra`` merged in) and ``<name>.md``; returns the markdown."""
    os.makedirs(RESULTS, exist_ok=True)
    info = machine()
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as fh:
        json.dump({"machine": info, "rows": rows, **(extra or {})}, fh, indent=2)
    lines = [f"### {title}", "",
             f"{info['date']}, jax {info['jax']}, {info['devices']} x {info['device_kind']} ({info['platform']}), "
             f"{info['cpu_count']} host cores", ""]
    if notes:
        lines += [notes, ""]
    lines.append("| " + " | ".join(c for c, _ in columns) + " |")
    lines.append("|" + " --- |" * len(columns))
    for row in rows:
        lines.append("| " + " | ".join(str(get(row)) for _, get in columns) + " |")
    text = "\n".join(lines) + "\n"
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as fh:
        fh.write(text)
    return text
