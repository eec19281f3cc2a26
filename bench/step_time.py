"""Step time: the same training step, explicit rewriter vs GSPMD, run alternately.

For each model and layout both programs are compiled, warmed up, then run A B A B ... (``pairs``
times each) so that machine load drifts hit both equally; the table gives the median of each and
the ratio explicit / gspmd. On a GPU it also reports MFU against the measured matmul peak.

Run: ``python -m bench.step_time [--quick]`` (writes bench/results/step_time.{json,md}).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import meshdsl as md  # noqa: E402
from bench import models  # noqa: E402
from bench.common import write  # noqa: E402

QUICK = {"dense": ["data parallel", "Megatron", "ZeRO-3", models.AUTO + "ZeRO-3"], "moe": ["expert parallel"]}


def _timed(f, args) -> float:
    t = time.perf_counter()
    jax.block_until_ready(f(*args))
    return time.perf_counter() - t


def matmul_peak_flops(n: int = 4096, repeats: int = 5) -> float:
    """Measured bf16 matmul throughput of one device (FLOP/s)."""
    a = jnp.ones((n, n), jnp.bfloat16)
    f = jax.jit(lambda a: a @ a)
    jax.block_until_ready(f(a))
    best = min(_timed(f, (a,)) for _ in range(repeats))
    return 2 * n ** 3 / best


def compare(fn, mesh, layout, args, pairs: int, **lower_kw) -> dict:
    runs = {"explicit": md.lower(fn, mesh, layout, **lower_kw), "gspmd": md.lower(fn, mesh, layout, backend="gspmd")}
    placed = md.place(args, mesh, layout)
    for f in runs.values():
        f.compile(*placed)
        for _ in range(2):  # warm-up
            _timed(f, placed)
    times = {k: [] for k in runs}
    for _ in range(pairs):
        for k, f in runs.items():
            times[k].append(_timed(f, placed))
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"explicit_s": med["explicit"], "gspmd_s": med["gspmd"], "ratio": med["explicit"] / med["gspmd"],
            "pairs": pairs, "samples": times}


def run(quick: bool = False, pairs: int = 5) -> str:
    rows = []
    gpu = jax.devices()[0].platform == "gpu"
    peak = matmul_peak_flops() if gpu else None
    for kind in ("dense", "moe"):
        for name, mesh, layout, fn, args, _, _ in models.cases(kind, quick):
            if quick and name not in QUICK[kind]:
                continue
            variants = [(name, models.lower_kwargs(name))]
            if name == "ZeRO-3":  # the FSDP trade: keep the gathered weights, or gather them again
                variants = [(f"{name} (keep)", {}), (f"{name} (re-gather)", {"param_gather": "regather"})]
            for label, kw in variants:
                r = compare(fn, mesh, layout, args, pairs, **kw)
                row = {"model": "t5-small x2 layers" if kind == "dense" else "MoE-T5 (8 experts) x2",
                       "layout": label, "mesh": str(mesh), **r}
                if gpu:
                    flops = md.explain(fn, mesh, layout, *args).flops
                    row["mfu"] = flops / r["explicit_s"] / peak
                rows.append(row)
                print(f"{row['model']:22s} {label:32s} explicit {r['explicit_s'] * 1e3:8.1f} ms  "
                      f"gspmd {r['gspmd_s'] * 1e3:8.1f} ms  ratio {r['ratio']:.3f}", flush=True)
    columns = [("model", lambda r: r["model"]), ("layout", lambda r: r["layout"]), ("mesh", lambda r: r["mesh"]),
               ("explicit ms (median)", lambda r: f"{r['explicit_s'] * 1e3:.1f}"),
               ("gspmd ms (median)", lambda r: f"{r['gspmd_s'] * 1e3:.1f}"),
               ("explicit / gspmd", lambda r: f"{r['ratio']:.3f}")]
    if gpu:
        columns.append(("MFU", lambda r: f"{r['mfu']:.1%}"))
    shapes = models.shapes(quick)
    return write("step_time", rows, columns, "Step time: one training step (loss + gradients)",
                 notes=f"Medians of {pairs} alternating pairs after 2 warm-up runs each; batch {shapes['batch']}, "
                       f"encoder {shapes['enc']} / decoder {shapes['dec']} tokens, float32.")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args()
    print(run(a.quick, a.pairs))
