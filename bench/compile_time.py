"""Compile time and scaling with depth: trace + lower, and XLA compile, of one training step for
2, 6, 12 and 24 encoder + decoder layers (t5-small widths, Megatron on data:2 x model:4, abstract
inputs: nothing is allocated). ``md.scan`` keeps one copy of a layer in the program, so the time
should not grow with depth (target: 24 layers <= 1.5 x 2 layers).

Run: ``python -m bench.compile_time [--quick]`` (writes bench/results/compile_time.{json,md}).
"""

from __future__ import annotations

import argparse
import time

from bench import common  # noqa: F401 - sets up devices first

import meshdsl as md  # noqa: E402
from bench import models  # noqa: E402
from bench.common import write  # noqa: E402

DEPTHS = (2, 6, 12, 24)


def measure(layers: int, quick: bool, backend: str = "explicit") -> dict:
    cfg = models.config("dense", layers, quick)
    s = models.shapes(quick)
    model = models.build(cfg, abstract=True)
    batch = models.batch_for(cfg, s["batch"], s["enc"], s["dec"], abstract=True)
    f = md.lower(models.train_step, md.Mesh.parse("data:2;model:4"), md.Layout(models.MEGATRON), backend=backend)
    t0 = time.perf_counter()
    lowered = f.lower(model, batch)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"layers": layers, "backend": backend, "trace_s": t1 - t0, "compile_s": t2 - t1, "total_s": t2 - t0}


def run(quick: bool = False) -> str:
    rows = []
    for backend in ("explicit", "gspmd"):
        for depth in DEPTHS:
            r = measure(depth, quick, backend)
            rows.append(r)
            print(f"{backend:8s} {depth:3d} layers: trace+lower {r['trace_s']:.2f}s compile {r['compile_s']:.2f}s",
                  flush=True)
    base = {r["backend"]: r["total_s"] for r in rows if r["layers"] == DEPTHS[0]}
    for r in rows:
        r["vs_2_layers"] = r["total_s"] / base[r["backend"]]
    columns = [("backend", lambda r: r["backend"]), ("encoder + decoder layers", lambda r: f"{r['layers']} + {r['layers']}"),
               ("trace + lower s", lambda r: f"{r['trace_s']:.2f}"), ("compile s", lambda r: f"{r['compile_s']:.2f}"),
               ("total s", lambda r: f"{r['total_s']:.2f}"), ("vs 2 layers", lambda r: f"{r['vs_2_layers']:.2f}")]
    return write("compile_time", rows, columns, "Compile time vs depth (one training step, t5-small widths)",
                 notes="Megatron layout on data:2 x model:4; abstract inputs. Target: 24 layers <= 1.5 x 2 layers.")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
