"""Pipeline benchmark: GPipe, 1F1B and circular pipelines as a layout, bytes and memory per step vs microbatches.

One training step (loss and gradients) of T5 with t5-small's widths (d_model 512, d_ff 2048, 8 heads
of 64, vocabulary 32128, no dropout) and 8 encoder + 8 decoder layers on mesh ``pipe:4 x data:2``,
layout ``batch:data;layers:pipe`` with ``M`` microbatches: both stacks are pipelines of S = 4 stages
(2 layers each). Schedules: GPipe (``M + S - 1`` ticks) and 1F1B (the decoder stack's loss as its
head, ``M + 2S - 2`` ticks with ``M + S - 2`` shifts each way; the encoder stays GPipe, its output
feeds the decoder) and circular with R = 2 repeats (the decoder's 8 layers cut into S R = 8 chunks of
one layer, chunk ``c`` on stage ``c mod S``: ``R M + S - 1`` ticks, shifts round the ring of stages;
M >= S, so not M = 2; the encoder stays GPipe as under 1F1B). For each schedule and M:

* **explicit**: bytes per device of the compiled step (``hlo_comm``), by kind;
* **explain**: what ``md.explain`` predicted before compiling;
* **gspmd**: the compiled bytes of ``backend="gspmd"`` (the same layout as sharding constraints: no
  pipeline, XLA decides), or why it does not compile;
* **minimum**: the ppermutes of one microbatch's activations per shift, forward and backward, for
  both stacks, ``2 (B/(n_d M)) d_model 4 (T_enc (M+S-1) + T_dec shifts_dec)`` (``shifts_dec``: M+S-1
  for GPipe, M+S-2 for 1F1B, R M+S-1 for circular), plus the data-parallel gradient
  sum ``2(n_d-1)/n_d * 4 * P_local`` (P_local: a device's parameters, layers split over pipe);
  circular adds the chunk moves of the decoder stack, ``2 * moves * C``: the layout stores the stack
  in blocks (chunk ``c`` on stage ``c // R``) and stage ``c mod S`` runs it, so once per step each
  chunk that changes stage goes there and its gradient comes back; ``moves`` is the most chunks one
  stage sends or receives (S = 4, R = 2: chunks 1..6 move, 2 per stage at most), ``C`` the bytes of
  one chunk's weights on a device (``L/(S R)`` decoder layers);
* **temp MiB**: ``compiled.memory_analysis().temp_size_in_bytes`` (activations kept for the backward
  pass: one microbatch's per tick and layer);
* **bubble**: the decoder pipeline's fraction of ticks a stage idles: ``(S-1)/(M+S-1)``, circular
  ``(S-1)/(R M+S-1)``.

``--quick``: a batch of 32 and 32 / 8 tokens (a few minutes on 2 cores); otherwise a batch of 64 and
128 / 32 tokens; M = 2, 4, 8, 16 both (circular: M = 4, 8, 16).

Run: ``python -m bench.pipeline [--quick]`` (writes bench/results/pipeline.{json,md}).
"""

from __future__ import annotations

import argparse
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.costmodel import hlo_comm  # noqa: E402
from bench import models  # noqa: E402
from bench.common import fmt_kinds, hlo_bytes, ratio, same_bytes, total, write  # noqa: E402
from meshdsl.models.loss import t5_loss  # noqa: E402

F32 = 4
MESH = "pipe:4;data:2"
LAYERS = 8
REPEATS = 2   # the circular schedule's chunks per stage


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


def chunk_moves(stages: int, repeats: int) -> int:
    """The most chunks one stage sends or receives to take the block placement of ``S R`` chunks
    (chunk ``c`` on stage ``c // R``) to the circular one (stage ``c mod S``)."""
    moving = [(c // repeats, c % stages) for c in range(stages * repeats) if c // repeats != c % stages]
    return max(max(sum(a == s for a, _ in moving), sum(b == s for _, b in moving)) for s in range(stages))


def decoder_layer_bytes(model) -> float:
    """Bytes of one decoder layer's weights (the stacked leaves of the decoder, whole on a device
    under ``batch:data;layers:pipe``)."""
    leaves = jax.tree_util.tree_leaves(nnx.state(model.decoder, nnx.Param),
                                       is_leaf=lambda x: isinstance(x, md.NamedArray))
    return sum(p.size // p.dims["layers"].size * F32 for p in leaves if "layers" in p.dims.names)


def minimum(cfg, model, mesh, layout, s: dict, m: int, schedule: str = "gpipe", repeats: int = 1) -> float:
    """The analytic minimum (see the module docstring)."""
    stages, n_d = mesh.shape["pipe"], mesh.shape["data"]
    rows = s["batch"] // (n_d * m)
    shifts_dec = {"1f1b": m + stages - 2, "circular": repeats * m + stages - 1}.get(schedule, m + stages - 1)
    act = rows * cfg.d_model * F32 * (s["enc"] * (m + stages - 1) + s["dec"] * shifts_dec)   # per direction
    permutes = 2 * act                                                      # forward and backward
    dp = 2 * (n_d - 1) / n_d * models.local_param_bytes(model, mesh, layout, axes_to_ignore=("data",))
    chunks = 0.0
    if schedule == "circular" and repeats > 1:   # weights to their stage, gradients back
        chunk = decoder_layer_bytes(model) * cfg.decoder_layers // (stages * repeats)
        chunks = 2 * chunk_moves(stages, repeats) * chunk
    return permutes + dp + chunks


def one(cfg, graphdef, state, model, batch, mesh, s, m, schedule="gpipe", repeats=1, gspmd=None) -> dict:
    """One row; ``gspmd``: ``(bytes, note)`` of the gspmd backend already measured at this M (it
    does not pipeline, so the schedule does not change its program)."""
    layout = md.Layout({"batch": "data", "layers": "pipe"}, microbatches={"batch": m})
    step = step_fn(graphdef)
    t = time.perf_counter()
    compiled = md.lower(step, mesh, layout, schedule=schedule, repeats=repeats).lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    rep = hlo_comm.analyze(compiled)
    explicit = {k: {"count": v["count"], "bytes": v["moved_bytes"]} for k, v in rep.summary().items()}
    report = md.explain(step, mesh, layout, state, batch, schedule=schedule, repeats=repeats)
    predicted = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in report.summary().items()}
    # md.explain's own count of the circular chunk moves (weights to their stage, gradients back)
    moved = sum(r.total_bytes for r in report.collectives if "chunks to their circular stage" in r.tensor)
    if gspmd is not None:
        gspmd, gspmd_note = gspmd
    else:
        try:
            gspmd, gspmd_note = hlo_bytes(md.lower(step, mesh, layout, backend="gspmd"), state, batch), ""
        except Exception as e:  # noqa: BLE001 - reported in the table, not hidden
            gspmd, gspmd_note = None, f"does not compile: {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    p = report.pipeline
    each = p.get("each", [p])          # the encoder's pipeline, then the decoder's
    return {"schedule": schedule, "repeats": repeats, "microbatches": m, "stages": p["stages"],
            "ticks": "/".join(str(e["ticks"]) for e in each),
            "schedules": "/".join(e["schedule"] for e in each),
            "bubble_fraction": each[-1]["bubble_fraction"],
            "explicit": explicit, "explain": predicted, "gspmd": gspmd, "gspmd_note": gspmd_note,
            "minimum": minimum(cfg, model, mesh, layout, s, m, schedule, repeats), "explain_chunk_bytes": moved,
            "temp_bytes": compiled.memory_analysis().temp_size_in_bytes,
            "explain_temp_bytes": report.memory["temporaries"], "compile_s": compile_s}


def name(r: dict) -> str:
    return r["schedule"] + (f" R={r['repeats']}" if r.get("repeats", 1) > 1 else "")


def run(quick: bool = False) -> str:
    s = sizes(quick)
    cfg = models.config("dense", LAYERS, quick)
    mesh = md.Mesh.parse(MESH)
    model = models.build(cfg, abstract=True)
    graphdef, state = nnx.split(model)
    batch = models.batch_for(cfg, s["batch"], s["enc"], s["dec"], abstract=True)
    rows = []
    stages = mesh.shape["pipe"]
    for m in s["microbatches"]:
        runs = [("gpipe", 1), ("1f1b", 1)] + [("circular", REPEATS)] * (m >= stages)   # circular: M >= S
        for schedule, repeats in runs:
            gspmd = (rows[-1]["gspmd"], rows[-1]["gspmd_note"]) if schedule != "gpipe" else None
            rows.append(one(cfg, graphdef, state, model, batch, mesh, s, m, schedule, repeats, gspmd))
            r = rows[-1]
            print(f"{name(r):13s} M={m:3d} explicit {total(r['explicit']) / 2**20:9.2f} MiB  "
                  f"minimum {r['minimum'] / 2**20:9.2f} MiB  explain = HLO {same_bytes(r['explain'], r['explicit'])}  "
                  f"temp {r['temp_bytes'] / 2**20:8.1f} MiB  compile {r['compile_s']:.0f} s", flush=True)
    mib = lambda b: f"{b / 2**20:.2f}"  # noqa: E731
    chunk_layers = cfg.decoder_layers // (stages * REPEATS)
    chunk_bytes, most = decoder_layer_bytes(model) * chunk_layers, chunk_moves(stages, REPEATS)
    moving = sum(c // REPEATS != c % stages for c in range(stages * REPEATS))
    columns = [
        ("schedule", name), ("M", lambda r: r["microbatches"]), ("ticks enc/dec", lambda r: r["ticks"]),
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
    return write("pipeline", rows, columns, "Pipelines (GPipe, 1F1B, circular) as a layout: one training step vs microbatches",
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
                       "layers' weights (one program for every schedule: measured once per M). "
                       f"circular R={REPEATS}: the decoder stack only (T5's encoder stack stays GPipe, ticks enc/dec); "
                       f"its bubble is (S-1)/(RM+S-1) instead of (S-1)/(M+S-1), for R M+S-1 ring shifts instead of "
                       f"M+S-1 and the chunk moves: the stack is stored in blocks (stage s holds chunks sR..sR+R-1) "
                       f"and chunk c runs on stage c mod S, so once per step {moving} of the {stages * REPEATS} "
                       f"chunks ({chunk_layers} decoder layer{'s' * (chunk_layers > 1)} each, "
                       f"{mib(chunk_bytes)} MiB) go to their stage and their gradients come back, at most "
                       f"{most} per stage each way: 2 * {most} * {mib(chunk_bytes)} = {mib(2 * most * chunk_bytes)} "
                       f"MiB in the minimum (md.explain's own count of these moves: explain_chunk_bytes in the json). "
                       f"Its other excesses are GPipe's. Its compiled temp memory is at or below GPipe's: the "
                       f"backward pass cuts each tick's chunk of weights again from the stack rather than keeping "
                       f"one per tick, and recomputes the stage's elementwise values (a remat keeping einsum and "
                       f"collective results; explain's estimate does not model it).")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
