"""Decoding: greedy tokens/s under the inference layouts, bytes per token, time per position.

t5-small widths (d_model 512, d_ff 2048, 8 heads x 64, vocab 32128) with few layers to keep CPU
time low, batch 8, on a ``data:2 x model:4`` mesh of 8 (virtual CPU) devices. For each inference
layout (:data:`meshdsl.models.inference.INFERENCE_LAYOUTS`) the one compiled decode step is run at
positions 8, 64 and 256 of one cache (its length fixed: the time per token should be flat), and
the table gives:

* tokens/s (batch / median step time) and the median step time at each position;
* bytes moved per device and step: ``md.explain``'s prediction, ``hlo_comm`` on the compiled step,
  and the analytic minimum of the layout (Pope et al.): batch-split 0; 1-D weight-stationary one
  all-reduce of ``[batch/data, d_model]`` per sub-layer plus the embedding's; weight-gathered the
  all-gather of every stored-split weight; kv-split one all-reduce of the attention output
  ``[batch/data, heads, d_kv]`` and its softmax statistics per self-attention; 2-D: the
  activations' all-gathers and reduce-scatters (no closed form here: "-");
* the memory each device reads per token (its parameters + its part of the KV cache and the
  cross-attention keys/values): the decode roofline's numerator.

Run: ``python -m bench.decode [--quick]`` (writes bench/results/decode.{json,md}).
"""

from __future__ import annotations

import argparse
import statistics
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from bench.common import write  # noqa: E402
from meshdsl.names.units import fmt_bytes as _fmt_bytes  # noqa: E402
from meshdsl.costmodel import hlo_comm  # noqa: E402
from meshdsl.models.configs import get_config  # noqa: E402
from meshdsl.models.generation import Generator, cache_length  # noqa: E402
from meshdsl.models.inference import INFERENCE_LAYOUTS, bytes_per_device  # noqa: E402
from meshdsl.models.t5 import T5  # noqa: E402

POSITIONS = (8, 64, 256)


def analytic_bytes(name: str, config, batch: int, mesh: md.Mesh, param_bytes_total: float) -> float | None:
    """Minimum bytes per device of one decode step under layout ``name`` (ring formulas)."""
    data, model = mesh.shape["data"], mesh.shape["model"]
    f32, L = 4, config.decoder_layers
    ar = lambda nbytes, n: 2 * (n - 1) / n * nbytes  # noqa: E731
    if name == "batch-split":
        return 0.0
    if name == "1d-weight-stationary":   # 3 sub-layers per layer + the vocab-split embedding lookup
        return (3 * L + 1) * ar(batch // data * config.d_model * f32, model)
    if name == "weight-gathered":        # every weight the step reads with a d_model, gathered once
        n = data * model
        return (n - 1) / n * param_bytes_total
    if name == "kv-split":               # attention output and (max, sum) statistics per self-attention
        return L * ar(batch // data * config.heads * (config.d_kv + 2) * f32, model)
    return None


def decode_param_bytes(model) -> float:
    """Bytes of the parameters a decode step reads that have a ``d_model`` dim (the decoder stack
    without the cross-attention key/value kernels, the embedding, the output layer): what
    weight-gathering must move."""
    parts = [model.decoder, model.decoder_norm, model.shared] + ([model.lm_head] if model.lm_head is not None else [])
    leaves = [leaf for part in parts for leaf in jax.tree_util.tree_leaves(
        nnx.state(part, nnx.Param), is_leaf=lambda x: isinstance(x, md.NamedArray))]
    total = sum(leaf.size * leaf.dtype.itemsize for leaf in leaves
                if isinstance(leaf, md.NamedArray) and "d_model" in leaf.names)
    for layer in model.decoder.layers:    # cross-attention keys/values were computed by the prefill
        for dense in (layer.cross_attention.k, layer.cross_attention.v):
            total -= dense.kernel.get_value().size * dense.kernel.get_value().dtype.itemsize
    return float(total)


def run(quick: bool = False) -> str:
    layers = 1 if quick else 2
    config = get_config("t5-small", encoder_layers=layers, decoder_layers=layers, dropout_rate=0.0)
    batch, enc_len, reps = 8, 32, (3 if quick else 10)
    mesh = md.Mesh({"data": 2, "model": 4})
    model = T5(config, rngs=nnx.Rngs(0))
    param_total = decode_param_bytes(model)
    ids = md.named(jnp.asarray(np.random.RandomState(0).randint(2, config.vocab, (batch, enc_len)), jnp.int32),
                   "batch length")
    max_length = cache_length(max(POSITIONS) + 1, mesh)
    rows = []
    for name, layout in INFERENCE_LAYOUTS.items():
        g = Generator(mesh, layout, layout)
        placed = md.place(model, mesh, layout)
        state = g.prefill(placed, ids, None, jnp.zeros((max_length,), jnp.int8))
        token = md.place(md.zeros([ids.dims["batch"]], jnp.int32), mesh, layout)
        done = md.place(md.zeros([ids.dims["batch"]], jnp.bool_), mesh, layout)
        key = jax.random.key(0)
        args = (placed, state, token, jnp.int32(0), done, key)
        t0 = time.perf_counter()
        compiled = g.step.compile(*args)
        compile_s = time.perf_counter() - t0
        hlo = sum(v["moved_bytes"] for v in hlo_comm.analyze(compiled).summary().values())
        explained = md.explain(g.step.fn, mesh, layout, *args)
        per_pos = {}
        for p in POSITIONS:
            a = (placed, state, token, jnp.int32(p), done, key)
            common.median_time(g.step, a, 1)                                    # warm-up
            per_pos[p] = common.median_time(g.step, a, reps)
        step_s = statistics.median(per_pos.values())
        mem = (bytes_per_device(nnx.state(model, nnx.Param), mesh, layout)
               + bytes_per_device(state["cache"], mesh, layout) + bytes_per_device(state["cross"], mesh, layout))
        row = {"layout": name, "rules": str(layout), "tokens_per_s": batch / step_s,
               **{f"ms_at_{p}": per_pos[p] * 1e3 for p in POSITIONS},
               "explain_bytes": explained.total_bytes, "hlo_bytes": hlo,
               "analytic_bytes": analytic_bytes(name, config, batch, mesh, param_total),
               "flops": explained.flops, "memory_read_per_token": mem, "compile_s": compile_s,
               "traces": dict(g.traces)}
        rows.append(row)
        print(f"{name:22s} {row['tokens_per_s']:8.1f} tok/s  " + "  ".join(
            f"@{p} {per_pos[p] * 1e3:6.1f} ms" for p in POSITIONS) + f"  explain {_fmt_bytes(row['explain_bytes'])}"
              f"  hlo {_fmt_bytes(hlo)}  read {_fmt_bytes(mem)}", flush=True)
    fmt_opt = lambda v: "-" if v is None else _fmt_bytes(v)  # noqa: E731
    columns = [("layout", lambda r: r["layout"]), ("tokens/s", lambda r: f"{r['tokens_per_s']:.0f}"),
               *[(f"ms/token @{p}", (lambda p: lambda r: f"{r[f'ms_at_{p}']:.1f}")(p)) for p in POSITIONS],
               ("bytes/step explain", lambda r: _fmt_bytes(r["explain_bytes"])),
               ("bytes/step HLO", lambda r: _fmt_bytes(r["hlo_bytes"])),
               ("analytic min", lambda r: fmt_opt(r["analytic_bytes"])),
               ("memory read/token", lambda r: _fmt_bytes(r["memory_read_per_token"])),
               ("GFLOP/step", lambda r: f"{r['flops'] / 1e9:.3f}")]
    return write("decode", rows, columns, "Decoding: greedy decode step under the inference layouts",
                 notes=f"t5-small widths, {layers}+{layers} layers, batch {batch}, encoder {enc_len} tokens, KV cache "
                       f"{max_length} positions, float32, mesh {mesh}; medians of {reps} steps per position; "
                       "bytes and memory per device and step (one token per batch row).")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
