"""MoE: the dropless layer against the capacity layer and the compiler, under expert parallelism.

Two shapes, each a training step (loss ``sum(y^2)``, gradients of the layer's parameters and its
input) of one MoE layer on 8 devices (mesh ``data:8``), gated-SiLU experts, float32, batch 16 x
seq 128 tokens of d_model 256:

* 8 experts, top-2, d_ff 512; 64 experts, top-8, d_ff 128 (fine-grained);
* the capacity layer :class:`meshdsl.layers.MoE` (Switch / GShard: ``capacity = ceil(group_size *
  factor * top_k / experts)`` slots per expert and group of one sequence, tokens past it dropped)
  at capacity factors 1.0, 1.25, 2.0, layout ``batch:data, group:data, experts:data``;
* the dropless layer :class:`meshdsl.layers.DroplessMoE` (``md.expert_ffn``: grouped matmuls,
  one all-to-all each way of a buffer no routing overflows), layout ``batch:data, experts:data``.

Per row: bytes moved per device by the step as ``md.explain`` predicts them and as the compiled
HLO moves them (``hlo_comm``), the same program under ``backend="gspmd"``, the analytic minimum of
the token exchange (each device sends its tokens' ``top_k`` assignments to the experts' devices
and gets them back, forward and backward, balanced routing: ``4 * tokens_local * top_k * d_model *
4 B * (n-1)/n``); step time (medians of alternating explicit/gspmd pairs after compiling and two
warm-up runs each); the compiled temporaries (``memory_analysis().temp_size_in_bytes``: on CPU
``peak_memory_in_bytes`` is only arguments + outputs) against explain's; the fraction of the
assignments dropped on the bench's random inputs (the dropless layer's is asserted 0); explain's
matmul FLOPs per device against the useful ones (``18 * tokens_local * top_k * d_model * d_ff``
for the experts, forward and backward), and the local grouped-matmul kernel the plan ran.

Run: ``python -m bench.moe [--quick]`` (writes bench/results/moe.{json,md}); ``--quick``: fewer
timed pairs (3 instead of 10), the same shapes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
import meshdsl.layers as L  # noqa: E402
from meshdsl.costmodel import hlo_comm, jaxpr_stats  # noqa: E402

B, S, D, F32, N = 16, 128, 256, 4, 8
SHAPES = ({"experts": 8, "top_k": 2, "d_ff": 512}, {"experts": 64, "top_k": 8, "d_ff": 128})
FACTORS = (1.0, 1.25, 2.0)
BOUND = 2.0   # the dropless layer's stated exchange bound (exchange_factor): x a balanced routing's rows
LAYOUTS = {"capacity": {"batch": "data", "group": "data", "experts": "data"},
           "dropless": {"batch": "data", "experts": "data"}}
CPU_NOTE = ("XLA:CPU has no grouped GEMM: it expands `ragged_dot` into one masked matmul per local expert "
            "(every row against every expert's kernel), and the plan takes the tiled loop "
            "(`meshdsl.ops.grouped.tiled`) instead where that is fewer FLOPs; GPUs/TPUs with grouped-GEMM "
            "kernels run only the rows' work, so the dropless CPU times overstate its compute there.")


def build(layer: str, shape: dict, factor: float | None):
    """The layer (gated-SiLU experts, seed 0)."""
    dims = (md.Dim("d_model", D), md.Dim("d_ff", shape["d_ff"]), md.Dim("experts", shape["experts"]))
    if layer == "dropless":
        return L.DroplessMoE(*dims, rngs=nnx.Rngs(0), top_k=shape["top_k"], activation="gated-silu",
                             exchange_factor=factor)
    return L.MoE(*dims, rngs=nnx.Rngs(0), top_k=shape["top_k"], capacity_factor=factor, activation="gated-silu")


def inputs() -> md.NamedArray:
    return md.named(jax.random.normal(jax.random.key(1), (B, S, D), jnp.float32), "batch seq d_model")


def train_step(module, x):
    """``((loss, dropped_fraction), (parameter gradients, input gradient))`` of ``sum(y^2)``."""
    graphdef, state = nnx.split(module)

    def loss(state, x):
        y, metrics = nnx.merge(graphdef, state)(x, train=True)
        return md.sum(md.square(y)).array, metrics["dropped_fraction"].array
    return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(state, x)


def minimum(shape: dict) -> float:
    """The token exchange's bytes per device: out and back, forward and backward, balanced."""
    return 4 * (B * S // N) * shape["top_k"] * D * F32 * (N - 1) / N


def useful_flops(shape: dict) -> float:
    """The experts' matmul FLOPs per device: three kernels, forward and two backward matmuls each."""
    return 18 * (B * S // N) * shape["top_k"] * D * shape["d_ff"]


def kernel_of(f, args) -> str:
    """The local expert matmuls the traced program runs: ``ragged`` (``ragged_dot``), ``tiled`` (a
    loop of tile matmuls) or ``einsum`` (the capacity layer's batched matmuls)."""
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            names.add(eqn.primitive.name)
            for sub in jaxpr_stats.sub_jaxprs(eqn):
                walk(sub)
    walk(f.trace(*args)[0].jaxpr)
    if "ragged_dot_general" in names:
        return "ragged"
    return "tiled" if names & {"scan", "while"} else "einsum"


def compiled(mesh, layout, args, backend: str) -> dict:
    """The lowered step under ``backend``, compiled: its callable, HLO bytes, temporaries; or
    the error that stopped it (``error``)."""
    f = md.lower(train_step, mesh, layout, backend=backend)
    try:
        c = f.compile(*args)
    except Exception as e:  # noqa: BLE001 - recorded in the row; the other backend still measured
        line = str(e).strip().splitlines()[0].replace("`", "'") if str(e).strip() else ""
        return {"error": f"{type(e).__name__}: {line[:160]}"}
    rep = hlo_comm.analyze(c)
    kinds = {k: {"count": v["count"], "bytes": v["moved_bytes"]} for k, v in rep.summary().items()}
    return {"f": f, "moved": rep.total_moved_bytes(), "kinds": kinds,
            "temporaries": c.memory_analysis().temp_size_in_bytes}


def measure_row(name: str, layer: str, shape: dict, factor: float | None, pairs: int) -> dict:
    """One layer at one shape: bytes, times, memory, drops and FLOPs (see the module docstring)."""
    mesh, layout = md.Mesh({"data": N}), md.Layout(LAYOUTS[layer])
    module = build(layer, shape, factor)
    args = md.place((module, inputs()), mesh, layout)
    report = md.explain(train_step, mesh, layout, *args)
    runs = {b: compiled(mesh, layout, args, b) for b in ("explicit", "gspmd")}
    ex, gs = runs["explicit"], runs["gspmd"]
    (_, dropped), _ = ex["f"](*args)
    dropped = float(dropped)
    if layer == "dropless" and factor is None:
        assert dropped == 0.0, f"the dropless layer dropped {dropped} of the assignments"
    timed = {b: r["f"] for b, r in runs.items() if "f" in r}
    samples = common.alternate(timed, args, pairs)
    med = {b: statistics.median(t) for b, t in samples.items()}
    explained = {k: {"count": v["count"], "bytes": v["bytes"]} for k, v in report.summary().items()}
    row = {"shape": name, "layer": layer, "capacity_factor": factor, "layout": str(layout), "mesh": str(mesh),
           "dropped_fraction": dropped, "explain_bytes": report.total_bytes, "explain_kinds": explained,
           "hlo_bytes": ex["moved"], "hlo_kinds": ex["kinds"], "gspmd_bytes": gs.get("moved"),
           "gspmd_kinds": gs.get("kinds"), "gspmd_error": gs.get("error"), "minimum_bytes": minimum(shape),
           "explicit_s": med["explicit"], "gspmd_s": med.get("gspmd"), "pairs": pairs, "samples": samples,
           "compiled_temporaries": ex["temporaries"], "gspmd_temporaries": gs.get("temporaries"),
           "explain_memory": {k: report.memory[k] for k in ("arguments", "outputs", "temporaries", "peak")},
           "explain_flops": report.flops, "useful_expert_flops": useful_flops(shape),
           "kernel": kernel_of(ex["f"], args)}
    if layer == "capacity":
        row["capacity"] = module.capacity(S, True)
    return row


def rows_of(pairs: int, shapes=SHAPES, factors=FACTORS) -> list:
    rows = []
    for shape in shapes:
        name = f"{shape['experts']} experts top-{shape['top_k']}, d_ff {shape['d_ff']}"
        for layer, factor in [("capacity", f) for f in factors] + [("dropless", None), ("dropless", BOUND)]:
            t = time.perf_counter()
            r = measure_row(name, layer, shape, factor, pairs)
            rows.append(r)
            gspmd = f"{r['gspmd_s'] * 1e3:7.1f} ms" if r["gspmd_s"] else "failed"
            print(f"{name:32s} {_label(r):16s} HLO {r['hlo_bytes'] / 2**20:7.2f} MiB (explain "
                  f"{r['explain_bytes'] / 2**20:7.2f}, min {r['minimum_bytes'] / 2**20:6.2f})  explicit "
                  f"{r['explicit_s'] * 1e3:7.1f} ms  gspmd {gspmd}  dropped {r['dropped_fraction']:.3f}  "
                  f"({time.perf_counter() - t:.0f} s)", flush=True)
    return rows


def _label(r) -> str:
    if r["layer"] == "dropless":
        return "dropless" if r["capacity_factor"] is None else f"dropless, bound {r['capacity_factor']}"
    return f"capacity {r['capacity_factor']} (C={r['capacity']})"


def _mib(b) -> str:
    return "n/a" if b is None else f"{b / 2**20:.2f}"


def _ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.1f}"


def _gspmd(r, value) -> str:
    return value if r["gspmd_error"] is None else "fails"


def columns() -> list:
    same = lambda r: "yes" if {k: v["bytes"] for k, v in r["explain_kinds"].items() if v["bytes"]} == \
        {k: v["bytes"] for k, v in r["hlo_kinds"].items() if v["bytes"]} else "NO"  # noqa: E731
    return [("shape", lambda r: r["shape"]), ("layer", _label),
            ("dropped", lambda r: f"{r['dropped_fraction']:.3f}"),
            ("explicit MiB (HLO)", lambda r: _mib(r["hlo_bytes"])), ("explain = HLO", same),
            ("gspmd MiB (HLO)", lambda r: _gspmd(r, _mib(r["gspmd_bytes"]))),
            ("explicit / gspmd", lambda r: _gspmd(r, common.ratio(r["hlo_bytes"], r["gspmd_bytes"] or 0))),
            ("exchange minimum MiB", lambda r: _mib(r["minimum_bytes"])),
            ("explicit / minimum", lambda r: common.ratio(r["hlo_bytes"], r["minimum_bytes"])),
            ("explicit ms", lambda r: _ms(r["explicit_s"])),
            ("gspmd ms", lambda r: _gspmd(r, _ms(r["gspmd_s"]))),
            ("time explicit / gspmd", lambda r: _gspmd(r, f"{r['explicit_s'] / r['gspmd_s']:.3f}"
                                                          if r["gspmd_s"] else "n/a"))]


def memory_columns() -> list:
    gflop = lambda f: f"{f / 1e9:.2f}"  # noqa: E731
    return [("shape", lambda r: r["shape"]), ("layer", _label),
            ("temporaries MiB (compiled)", lambda r: _mib(r["compiled_temporaries"])),
            ("temporaries MiB (explain)", lambda r: _mib(r["explain_memory"]["temporaries"])),
            ("explain / compiled",
             lambda r: common.ratio(r["explain_memory"]["temporaries"], r["compiled_temporaries"])),
            ("explain peak MiB", lambda r: _mib(r["explain_memory"]["peak"])),
            ("local expert kernel", lambda r: r["kernel"]),
            ("explain GFLOP / device", lambda r: gflop(r["explain_flops"])),
            ("useful expert GFLOP / device", lambda r: gflop(r["useful_expert_flops"])),
            ("explain / useful", lambda r: f"{r['explain_flops'] / r['useful_expert_flops']:.2f}")]


def findings(rows: list) -> str:
    """What the table shows, in numbers from its rows."""
    parts = []
    for shape in dict.fromkeys(r["shape"] for r in rows):
        cap = next((r for r in rows if r["shape"] == shape and r["capacity_factor"] == 1.0), None)
        dl = next((r for r in rows if r["shape"] == shape and r["layer"] == "dropless"
                   and r["capacity_factor"] is None), None)
        bound = next((r for r in rows if r["shape"] == shape and r["layer"] == "dropless"
                      and r["capacity_factor"] is not None), None)
        if bound:
            parts.append(f"{shape}, a stated bound of {bound['capacity_factor']}x the balanced rows: "
                         f"{bound['hlo_bytes'] / bound['minimum_bytes']:.1f}x the minimum's bytes, "
                         f"{bound['explicit_s'] / cap['explicit_s']:.1f}x capacity 1.0's time, "
                         f"{bound['dropped_fraction']:.1%} of the assignments over it (counted, and a training run "
                         "stops on them)" if cap else "")
        if cap and dl:
            parts.append(f"{shape}: dropless {dl['hlo_bytes'] / dl['minimum_bytes']:.1f}x the minimum's bytes and "
                         f"{dl['explicit_s'] / cap['explicit_s']:.1f}x the time of capacity 1.0, which is at "
                         f"{cap['hlo_bytes'] / cap['minimum_bytes']:.2f}x the minimum but drops "
                         f"{cap['dropped_fraction']:.1%}" + (f" (gspmd, which partitions the dropless layer's "
                         f"global sort itself, moves {dl['gspmd_bytes'] / dl['hlo_bytes']:.0f}x its bytes)"
                         if dl["gspmd_bytes"] else ""))
    if not parts:
        return ""
    return ("**Shows:** the dropless layer never drops, but its all-to-all buffer is sized for any routing "
            "(tokens x min(top_k, local experts) rows per destination), so it moves, holds and (on CPU) computes "
            "that buffer: " + "; ".join(parts) + ". ")


def notes(rows: list, pairs: int, quick: bool) -> str:
    failed = sorted({r["gspmd_error"] for r in rows if r["gspmd_error"]})
    text = (f"One MoE layer's training step (loss sum(y^2), gradients of its parameters and input), batch {B} x "
            f"seq {S}, d_model {D}, gated-SiLU experts, float32, mesh data:{N}: the capacity layer (`layers.MoE`, "
            f"groups of one sequence, C slots per expert and group) under `{md.Layout(LAYOUTS['capacity'])}`, "
            f"the dropless one (`layers.DroplessMoE`, `md.expert_ffn`) under `{md.Layout(LAYOUTS['dropless'])}`. "
            f"Bytes moved per device; `dropped`: fraction of the top-k assignments dropped on these random "
            f"inputs. Exchange minimum: 4 x tokens/device x top_k x d_model x 4 B x (n-1)/n (out and back, "
            f"forward and backward, balanced routing). Times: medians of {pairs} alternating explicit/gspmd pairs "
            f"after 2 warm-up runs each; the 8 virtual devices share {os.cpu_count()} host cores. {CPU_NOTE}")
    if failed:
        text += " gspmd `fails`: " + "; ".join(f"`{e}`" for e in failed) + "."
    return ("**--quick.** " if quick else "") + findings(rows) + text


def run(quick: bool = False, pairs: int | None = None, out: str | None = None, shapes=SHAPES,
        factors=FACTORS) -> str:
    """The table (markdown), written with the JSON to ``out``; ``shapes``/``factors``: a subset
    (the smoke test's)."""
    pairs = pairs or (3 if quick else 10)
    start = time.perf_counter()
    rows = rows_of(pairs, shapes, factors)
    return render(rows, pairs, quick, {"seconds": time.perf_counter() - start}, out)


def render(rows: list, pairs: int, quick: bool, extra: dict, out: str | None = None) -> str:
    """Write ``moe.json`` and ``moe.md`` for measured ``rows``; returns the markdown."""
    return common.write("moe", rows, columns(), "MoE: dropless vs capacity experts, expert parallelism on 8 devices",
                        notes=notes(rows, pairs, quick),
                        tables=[("**Memory and local compute per device** (explain's FLOPs count what the plan's "
                                 "kernel runs: the padded exchange buffer, and on CPU every local expert's masked "
                                 "matmul for `ragged`)", rows, memory_columns())],
                        extra={**extra, "quick": quick, "cpu_note": CPU_NOTE}, out=out)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="3 timed pairs instead of 10")
    p.add_argument("--pairs", type=int, default=None, help="alternating timed pairs (default 10, --quick 3)")
    p.add_argument("--out", default=None, help="directory for moe.json and moe.md (default bench/results)")
    a = p.parse_args(argv)
    print(run(a.quick, a.pairs, a.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
