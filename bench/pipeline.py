"""Pipeline benchmark: GPipe and 1F1B pipelines as a layout, bytes and memory per training step vs microbatches.

One training step (loss and gradients) of T5 with t5-small's widths (d_model 512, d_ff 2048, 8 heads
of 64, vocabulary 32128, no dropout) and 8 encoder + 8 decoder layers on mesh ``pipe:4 x data:2``,
layout ``batch:data;layers:pipe`` with ``M`` microbatches: both stacks are pipelines of S = 4 stages
(2 layers each). Schedules: GPipe (``M + S - 1`` ticks) and 1F1B (the decoder stack's loss as its
head, ``M + 2S - 2`` ticks with ``M + S - 2`` shifts each way; the encoder stays GPipe, its output
feeds the decoder). For each schedule and M:

* **explicit**: bytes per device of the compiled step (``hlo_comm``), by kind;
* **explain**: what ``md.explain`` predicted before compiling;
* **gspmd**: the compiled bytes of ``backend="gspmd"`` (the same layout as sharding constraints: no
  pipeline, XLA decides), or why it does not compile;
* **minimum**: the ppermutes of one microbatch's activations per shift, forward and backward, for
  both stacks, ``2 (B/(n_d M)) d_model 4 (T_enc (M+S-1) + T_dec shifts_dec)`` (``shifts_dec``: M+S-1
  for GPipe, M+S-2 for 1F1B), plus the data-parallel gradient
  sum ``2(n_d-1)/n_d * 4 * P_local`` (P_local: a device's parameters, layers split over pipe);
* **temp MiB**: ``compiled.memory_analysis().temp_size_in_bytes`` (activations kept for the backward
  pass: one microbatch's per tick and layer);
* **bubble**: ``(S-1)/(M+S-1)``, the fraction of ticks a stage idles.

``--quick``: a batch of 32 and 32 / 8 tokens (a few minutes on 2 cores); otherwise a batch of 64 and
128 / 32 tokens; M = 2, 4, 8, 16 both.

Run: ``python -m bench.pipeline [--quick]`` (writes bench/results/pipeline.{json,md}).
"""

from __future__ import annotations

import argparse
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl import hlo_comm  # noqa: E402
from bench import models  # noqa: E402
from bench.common import fmt_kinds, hlo_bytes, ratio, same_bytes, total, write  # noqa: E402
from meshdsl.models.loss import t5_loss  # noqa: E402

F32 = 4
MESH = "pipe:4;data:2"
LAYERS = 8


def sizes(quick: bool) -> dict:
    if quick:
        return dict(batch=32, enc=32, dec=8, microbatches=(2, 4, 8, 16))
    return dict(batch=64, enc=128, dec=32, microbatches=(2, 4, 8, 16))


def step_fn(graphdef):
    def step(params, batch):
        def loss_fn(p):
            return t5_loss(nnx.merge(graphdef, p), batch, train=True)[0].array
        return jax.value_and_grad(loss_fn)(params)
    return step


def minimum(cfg, model, mesh, layout, s: dict, m: int, schedule: str = "gpipe") -> float:
    """The analytic minimum (see the module docstring)."""
    stages, n_d = mesh.shape["pipe"], mesh.shape["data"]
    rows = s["batch"] // (n_d * m)
    shifts_dec = m + stages - (2 if schedule == "1f1b" else 1)
    act = rows * cfg.d_model * F32 * (s["enc"] * (m + stages - 1) + s["dec"] * shifts_dec)   # per direction
    permutes = 2 * act                                                      # forward and backward
    dp = 2 * (n_d - 1) / n_d * models.local_param_bytes(model, mesh, layout, axes_to_ignore=("data",))
    return permutes + dp


def one(cfg, graphdef, state, model, batch, mesh, s, m, schedule="gpipe") -> dict:
    layout = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": m})
    step = step_fn(graphdef)
    t = time.perf_counter()
    compiled = md.lower(step, mesh, layout, schedule=schedule).lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    rep = hlo_comm.analyze(compiled)
    explicit = {k: {"count": v["count"], "bytes": v["moved_bytes"]} for k, v in rep.summary().items()}
    report = md.explain(step, mesh, layout, state, batch, schedule=schedule)
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in report.summary().items()}
    try:
        gspmd, gspmd_note = hlo_bytes(md.lower(step, mesh, layout, backend="gspmd"), state, batch), ""
    except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
        gspmd, gspmd_note = None, f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    p = report.pipeline
    each = p.get("each", [p])          # the encoder's pipeline, then the decoder's
    return {"schedule": schedule, "microbatches": m, "stages": p["stages"],
            "ticks": "/".join(str(e["ticks"]) for e in each),
            "schedules": "/".join(e["schedule"] for e in each),
            "bubble_fraction": each[-1]["bubble_fraction"],
            "explicit": explicit, "explain": predicted, "gspmd": gspmd, "gspmd_note": gspmd_note,
            "minimum": minimum(cfg, model, mesh, layout, s, m, schedule),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "explain_temp_bytes": report.memory["temporaries"], "compile_s": compile_s}


def run(quick: bool = False) -> str:
    s = sizes(quick)
    cfg = models.config("dense", LAYERS, quick)
    mesh = md.Mesh.parse(MESH)
    model = models.build(cfg, abstract=True)
    graphdef, state = nnx.split(model)
    batch = models.batch_for(cfg, s["batch"], s["enc"], s["dec"], abstract=True)
    rows = []
    for m in s["microbatches"]:
        for schedule in ("gpipe", "1f1b"):
            rows.append(one(cfg, graphdef, state, model, batch, mesh, s, m, schedule))
            r = rows[-1]
            print(f"{schedule:5s} M={m:3d} explicit {total(r['explicit']) / 2**20:9.2f} MiB  "
                  f"minimum {r['minimum'] / 2**20:9.2f} MiB  explain = HLO {same_bytes(r['explain'], r['explicit'])}  "
                  f"temp {r['temp_bytes'] / 2**20:8.1f} MiB  compile {r['compile_s']:.0f} s", flush=True)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    columns = [
        ("schedule", lambda r: r["schedule"]), ("M", lambda r: r["microbatches"]), ("ticks enc/dec", lambda r: r["ticks"]),
        ("bubble", lambda r: f"{r['bubble_fraction']:.0%}"),
        ("explicit (HLO)", lambda r: fmt_kinds(r["explicit"])),
        ("explicit MiB", lambda r: mib(total(r["explicit"]))),
        ("minimum MiB", lambda r: mib(r["minimum"])),
        ("explicit / minimum", lambda r: ratio(total(r["explicit"]), r["minimum"])),
        ("explain = HLO", lambda r: "yes" if same_bytes(r["explain"], r["explicit"]) else "no"),
        ("gspmd (HLO)", lambda r: fmt_kinds(r["gspmd"]) if r["gspmd"] is not None else r["gspmd_note"]),
        ("explicit / gspmd", lambda r: ratio(total(r["explicit"]), total(r["gspmd"])) if r["gspmd"] else "-"),
        ("temp MiB (compiled)", lambda r: mib(r["temp_bytes"])),
        ("temp MiB (explain)", lambda r: mib(r["explain_temp_bytes"])),
    ]
    return write("pipeline", rows, columns, "Pipelines (GPipe, 1F1B) as a layout: one training step vs microbatches",
                 notes=f"t5-small widths (d_model 512, d_ff 2048, 8 heads x 64, vocab 32128), {LAYERS} + {LAYERS} "
                       f"layers, float32, batch {s['batch']}, {s['enc']} / {s['dec']} tokens; mesh pipe:4 x data:2, "
                       "layout `batch:data;layers:pipe`, M microbatches. minimum = ppermutes of one microbatch's "
                       "activations per shift, forward and backward, both stacks (1F1B: the decoder's M+S-2 shifts, "
                       "the encoder's GPipe M+S-1) + 2(n-1)/n * 4 * P_local over data. "
                       "Above the minimum (the same for every M): all-reduces over pipe of each stack's output (the "
                       "finished microbatches are on the last stage) and of the gradient of each stack's input "
                       "(it arrives on the first), once per step, and a second all-reduce of the encoder output after "
                       "its final norm (the norm's scaling keeps the pending sum, reduced again where the decoder "
                       "reads it). 1F1B's all-reduces are about 110 MiB more: the decoder's head (logits on the tied embedding) runs on the last stage inside the schedule, so the embedding's gradient from it is all-reduced over pipe x data (2*7/8 * 62.75 = 109.81 MiB) apart from the data all-reduce of its gradient from the embedding lookup; one all-reduce of their sum would save 62.75 MiB (not done: the lookup's gradient is the same on every stage, so it cannot join a sum over pipe as it is). gspmd: the same layout as sharding constraints, no pipeline: XLA gathers the "
                       "layers' weights.")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
