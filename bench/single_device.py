"""Single device: what the rewriter costs where nothing is sharded, and the step's MFU.

One training step (loss and gradients) of t5-small (6 + 6 layers, d_model 512, vocabulary 32128,
no dropout) on one device, mesh ``data:1``, layout ``batch:data``, in float32 and in bfloat16
compute (float32 parameters), lowered by the explicit rewriter and by ``backend="gspmd"``. Both are
compiled, warmed up and run alternately (A B A B ...); the table gives the medians, the ratio
explicit / gspmd, tokens per second (encoder + decoder tokens) and, on an accelerator, the MFU:
``md.explain``'s flops over the step time and the device's measured bf16 matmul rate (XLA's own
cost analysis counts a scanned layer once and, on a GPU, leaves out the matmuls run as library
calls). meshdsl supports jax 0.10; where the accelerator's jax is newer, ``md.explain`` may not
read its programs and the MFU columns say n/a (the timings stand).

On one device the two lowerings should compile to the same program: a ratio far from 1 is
overhead of the rewriter (extra copies, casts, lost fusion).

Run: ``python -m bench.single_device [--quick]`` (writes bench/results/single_device.{json,md}).
``--quick``: 2 + 2 layers, batch 4, 64 / 16 tokens (for a CPU).
"""

from __future__ import annotations

import argparse

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import meshdsl as md  # noqa: E402
from bench import models  # noqa: E402
from bench.common import write  # noqa: E402
from bench.step_time import compare, matmul_peak_flops  # noqa: E402
from meshdsl.models.configs import get_config  # noqa: E402
from meshdsl.models.t5 import T5  # noqa: E402
from flax import nnx  # noqa: E402


def sizes(quick: bool) -> dict:
    if quick:
        return dict(layers=2, batch=4, enc=64, dec=16)
    return dict(layers=6, batch=32, enc=512, dec=128)


def _flops(fn, mesh, layout, args):
    """``md.explain``'s flops of the step (scans counted per trip), or None where explain cannot
    read this jax's programs (jax outside the range meshdsl supports)."""
    try:
        return md.explain(fn, mesh, layout, *args).flops
    except Exception as e:  # noqa: BLE001 - reported in the table, the timings stand
        print(f"md.explain failed on jax {jax.__version__}: {type(e).__name__}: {e}; no MFU", flush=True)
        return None


def run(quick: bool = False, pairs: int = 5) -> str:
    s = sizes(quick)
    cfg = get_config("t5-small").replace(encoder_layers=s["layers"], decoder_layers=s["layers"], dropout_rate=0.0)
    batch = models.batch_for(cfg, s["batch"], s["enc"], s["dec"])
    mesh, layout = md.Mesh({"data": 1}, devices=jax.devices()[:1]), md.Layout({"batch": "data"})
    accelerator = jax.devices()[0].platform != "cpu"
    peak = matmul_peak_flops(8192) if accelerator else None
    tokens = s["batch"] * (s["enc"] + s["dec"])
    rows = []
    for dtype in (jnp.float32, jnp.bfloat16):
        model = T5(cfg, rngs=nnx.Rngs(0), dtype=dtype)
        args = (model, batch)
        r = compare(models.train_step, mesh, layout, args, pairs)
        row = {"dtype": jnp.dtype(dtype).name, **{k: v for k, v in r.items() if k != "samples"},
               "tokens_per_s": tokens / r["explicit_s"]}
        if accelerator:
            row["flops"] = _flops(models.train_step, mesh, layout, args)
            row["mfu"] = None if row["flops"] is None else row["flops"] / r["explicit_s"] / peak
        rows.append(row)
        print(f"{row['dtype']:9s} explicit {r['explicit_s'] * 1e3:8.2f} ms  gspmd {r['gspmd_s'] * 1e3:8.2f} ms  "
              f"ratio {r['ratio']:.3f}", flush=True)
    columns = [("compute dtype", lambda r: r["dtype"]),
               ("explicit ms (median)", lambda r: f"{r['explicit_s'] * 1e3:.2f}"),
               ("gspmd ms (median)", lambda r: f"{r['gspmd_s'] * 1e3:.2f}"),
               ("explicit / gspmd", lambda r: f"{r['ratio']:.3f}"),
               ("tokens/s (explicit)", lambda r: f"{r['tokens_per_s']:,.0f}")]
    if accelerator:
        columns += [("TFLOP/s (explicit)", lambda r: "n/a" if r["flops"] is None else
                     f"{r['flops'] / r['explicit_s'] / 1e12:.0f}"),
                    ("MFU (explicit)", lambda r: "n/a" if r["mfu"] is None else f"{r['mfu']:.1%}")]
    notes = (f"t5-small, {s['layers']} + {s['layers']} layers, batch {s['batch']}, {s['enc']} / {s['dec']} tokens, "
             f"float32 parameters; medians of {pairs} alternating pairs after 2 warm-up runs each")
    if accelerator:
        notes += f"; measured bf16 matmul peak {peak / 1e12:.0f} TFLOP/s"
    return write("single_device", rows, columns, "Single device: one training step, explicit vs gspmd", notes=notes)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--pairs", type=int, default=5)
    a = p.parse_args()
    print(run(a.quick, a.pairs))
