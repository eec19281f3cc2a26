"""Pipeline schedules: GPipe vs 1F1B, one training step vs microbatches, bytes and temp memory.

A stack of 8 feed-forward residual layers at t5-small's widths (``h + relu(h W1) W2``, d_model 512,
d_ff 2048, 128 tokens per row) with the loss (a sum of squares over the rows, scaled) as the scan's
``head``, on mesh ``pipe:4 x data:2``, layout ``batch:data;layers:pipe``, M microbatches of a fixed
size (2 rows per device and microbatch: the global batch grows with M, as when microbatches are
added to reach a larger batch). For each schedule and M:

* **explicit**: bytes per device of the compiled step (``hlo_comm``); **explain = HLO**;
* **minimum**: one microbatch's activations shifted ``M + S - 2`` times forward and as many backward
  (each microbatch crosses ``S - 1`` stage boundaries each way: ``M (S - 1)`` shifts, ``M + S - 2``
  ticks in lockstep; GPipe sends one more each way, on a tick whose result nothing reads), plus
  the data-parallel gradient sum ``2(n_d - 1)/n_d * 4 * P_local``;
* **temp MiB**: ``compiled.memory_analysis().temp_size_in_bytes``: GPipe keeps every tick's
  activations for its backward pass, 1F1B at most ``2S - 1`` microbatch inputs per stage (and
  recomputes the stage's forward pass in its backward pass);
* **bubble**: ``(S-1)/(M+S-1)`` for both (1F1B's idle phases are conds that compute nothing).

Run: ``python -m bench.schedules [--quick]`` (writes bench/results/schedules.{json,md}); ``--quick``:
32 tokens per row.
"""

from __future__ import annotations

import argparse

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.costmodel import hlo_comm  # noqa: E402
from bench.common import fmt_kinds, ratio, same_bytes, total, write  # noqa: E402

F32 = 4
LAYERS, D_MODEL, D_FF, ROWS = 8, 512, 2048, 2     # ROWS: per device and microbatch
MESH = {"pipe": 4, "data": 2}


def step_fn(tokens: int):
    def loss(x, w1, w2):
        def layer(h, w):
            return h + md.einsum(md.relu(md.einsum(h, w["w1"], out="batch length d_ff")), w["w2"],
                                 out="batch length d_model"), None
        scale = 1.0 / (x.dims["batch"].size * tokens)
        return md.scan(layer, x, {"w1": w1, "w2": w2}, dim="layers",
                       head=lambda h: md.sum(md.square(h)) * scale)[0]

    def step(x, w1, w2):
        return jax.value_and_grad(lambda w1, w2: loss(x, w1, w2).array, argnums=(0, 1))(w1, w2)
    return step


def inputs(m: int, tokens: int, abstract: bool = True):
    batch = ROWS * MESH["data"] * m
    shapes = {"x": ((batch, tokens, D_MODEL), "batch length d_model"),
              "w1": ((LAYERS, D_MODEL, D_FF), "layers d_model d_ff"), "w2": ((LAYERS, D_FF, D_MODEL), "layers d_ff d_model")}
    out = []
    for k, (shape, names) in shapes.items():
        a = md.named(jax.ShapeDtypeStruct(shape, jnp.float32), names)
        out.append(a if k == "x" else md.param(a))
    return out


def minimum(m: int, tokens: int) -> float:
    stages, n_d = MESH["pipe"], MESH["data"]
    act = ROWS * tokens * D_MODEL * F32
    local_params = 2 * LAYERS // stages * D_MODEL * D_FF * F32
    return 2 * (m + stages - 2) * act + 2 * (n_d - 1) / n_d * local_params


def one(schedule: str, m: int, tokens: int) -> dict:
    mesh = md.Mesh(MESH)
    layout = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": m})
    step, args = step_fn(tokens), inputs(m, tokens)
    compiled = md.lower(step, mesh, layout, schedule=schedule).lower(*args).compile()
    explicit = {k: {"count": v["count"], "bytes": v["moved_bytes"]}
                for k, v in hlo_comm.analyze(compiled).summary().items()}
    report = md.explain(step, mesh, layout, *args, schedule=schedule)
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in report.summary().items()}
    p = report.pipeline
    return {"schedule": schedule, "microbatches": m, "ticks": p["ticks"], "bubble_fraction": p["bubble_fraction"],
            "explicit": explicit, "explain": predicted, "minimum": minimum(m, tokens),
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes}


def run(quick: bool = False) -> str:
    tokens = 32 if quick else 128
    rows = []
    for m in (2, 4, 8, 16):
        for schedule in ("gpipe", "1f1b"):
            rows.append(one(schedule, m, tokens))
            r = rows[-1]
            print(f"{schedule:6s} M={m:3d} explicit {total(r['explicit']) / 2**20:8.2f} MiB  minimum "
                  f"{r['minimum'] / 2**20:8.2f} MiB  temp {r['temp_bytes'] / 2**20:8.1f} MiB", flush=True)
    by = {(r["schedule"], r["microbatches"]): r for r in rows}
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    columns = [
        ("schedule", lambda r: r["schedule"]), ("M", lambda r: r["microbatches"]), ("ticks", lambda r: r["ticks"]),
        ("bubble", lambda r: f"{r['bubble_fraction']:.0%}"),
        ("explicit (HLO)", lambda r: fmt_kinds(r["explicit"])),
        ("explicit MiB", lambda r: mib(total(r["explicit"]))), ("minimum MiB", lambda r: mib(r["minimum"])),
        ("explicit / minimum", lambda r: ratio(total(r["explicit"]), r["minimum"])),
        ("explain = HLO", lambda r: "yes" if same_bytes(r["explain"], r["explicit"]) else "no"),
        ("temp MiB (compiled)", lambda r: mib(r["temp_bytes"])),
        ("temp / GPipe's", lambda r: ratio(r["temp_bytes"], by[("gpipe", r["microbatches"])]["temp_bytes"])),
    ]
    return write("schedules", rows, columns, "Pipeline schedules: GPipe vs 1F1B, one training step vs microbatches",
                 notes=f"{LAYERS} feed-forward residual layers at t5-small widths (d_model {D_MODEL}, d_ff {D_FF}), "
                       f"{tokens} tokens per row, float32, the loss as the scan's head; mesh pipe:4 x data:2, layout "
                       f"`batch:data;layers:pipe`, M microbatches of {ROWS} rows per device (the batch grows with M). "
                       "minimum = one microbatch's activations shifted M+S-2 times each way + 2(n-1)/n * 4 * P_local "
                       "over data. GPipe above it: an all-reduce over pipe of the finished microbatches (they are on "
                       "the last stage) and of the input's gradient, which grow with the batch; 1F1B reduces only the "
                       "scalar loss.")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
