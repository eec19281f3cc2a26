"""GPU: a Llama-2-7B-width decoder's training step on one device, explicit rewriter vs GSPMD.

Llama-2-7B's widths (d_model 4096, d_ff 11008, 32 heads, 32 key/value heads, vocabulary 32000)
cut to 4 layers, bfloat16 compute with float32 parameters, one device (mesh ``data:1``, layout
``batch:data``), at batch 4 x 2048 and 1 x 8192 tokens. For each shape:

* **step time**: loss and gradients (``nnx.value_and_grad`` of ``lm_loss``) lowered by
  ``md.lower(..., backend="explicit")`` and ``backend="gspmd"``, compiled, warmed up twice, then
  run alternately (E G E G ..., ``--pairs``); medians, their ratio, tokens/s, TFLOP/s and MFU.
  FLOPs are the analytic model FLOPs: ``6 * N * tokens`` (N: the parameters of the matmuls - the
  layers and the output projection, not the embedding lookup) plus causal attention,
  ``6 * layers * batch * seq^2 * heads * d_head`` (q.k and p.v, forward and backward, the unmasked
  half only). ``md.explain``'s matmul FLOPs go in the JSON too (they leave out cuDNN's fused
  attention, a library call). MFU is given against the hardware profile's bf16 peak (989 TFLOP/s
  on an H100) and against the bf16 matmul rate measured here (an 8192^3 ``jnp.dot``);
* **memory**: ``md.explain``'s peak per device against the compiled explicit program's
  ``memory_analysis()`` (``peak_memory_in_bytes`` where the backend reports it, else arguments +
  outputs + temporaries, the split explain uses);
* **predicted time**: ``md.explain(...).time(md.Hardware.profile(...))`` (the profile of the
  device: ``h100-80gb`` on an H100) against the measured explicit step;
* **attention alone**: ``md.attention`` at the step's shape (causal, bf16), forward and
  backward, cuDNN's fused kernel (``implementation="cudnn"``) against meshdsl's blockwise one
  (``implementation="flash"``), alternating; where cuDNN is unavailable (a CPU) the row says so.

Run on a GPU machine (about 3 minutes on one H100):

    pip install -e . --no-deps      # into an environment that has jax[cuda] and flax
    python -m bench.gpu [--pairs 10] [--out DIR]

Writes ``gpu.json`` and ``gpu.md`` to ``bench/results`` (or ``--out``). ``--quick``: 2 layers of
d_model 256 at short sequences, for a CPU (a smoke test, seconds). Without a GPU and without
``--quick`` it says so and exits 2.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from bench.common import alternate, write  # noqa: E402
from bench.step_time import matmul_peak_flops  # noqa: E402
from meshdsl.models.llama import Llama  # noqa: E402
from meshdsl.models.llama_configs import LLAMA_CONFIGS  # noqa: E402
from meshdsl.models.loss import lm_loss  # noqa: E402
from meshdsl.names.units import fmt_bytes  # noqa: E402

PROFILES = {"H100": "h100-80gb", "H200": "h200", "A100": "a100-80gb"}   # device_kind substring -> profile


def setup(quick: bool) -> dict:
    """The model config, the (batch, seq) shapes, and the matmul size for the peak."""
    cfg = LLAMA_CONFIGS["llama-2-7b"].replace(layers=4)
    if quick:
        cfg = cfg.replace(name="llama-quick", d_model=256, d_ff=512, heads=4, kv_heads=4, vocab=1024, layers=2)
        return dict(cfg=cfg, shapes=[(2, 64)], matmul=512)
    return dict(cfg=cfg, shapes=[(4, 2048), (1, 8192)], matmul=8192)


def profile_name(device) -> str:
    if device.platform == "cpu":
        return "cpu"
    return next((p for k, p in PROFILES.items() if k in device.device_kind), "h100-80gb")


def model_flops(cfg, batch: int, seq: int) -> float:
    """Analytic FLOPs of one training step (see the module docstring)."""
    dh = cfg.head_dim
    per_layer = cfg.d_model * dh * (2 * cfg.heads + 2 * cfg.kv_heads) + 3 * cfg.d_model * cfg.d_ff
    n = cfg.layers * per_layer + cfg.d_model * getattr(cfg, "padded_vocab", cfg.vocab)   # the logits matmul
    return 6 * n * batch * seq + 6 * cfg.layers * batch * seq ** 2 * cfg.heads * dh


def make_batch(cfg, batch: int, seq: int) -> dict:
    r = np.random.RandomState(0)
    targets = r.randint(1, cfg.vocab, (batch, seq))
    inputs = np.concatenate([np.zeros((batch, 1), targets.dtype), targets[:, :-1]], 1)
    return {"decoder_input_tokens": md.named(jnp.asarray(inputs), "batch targets"),
            "decoder_target_tokens": md.named(jnp.asarray(targets), "batch targets")}


def train_step(model, batch):
    """Loss and gradients of one step."""
    def loss_fn(m):
        loss, _ = lm_loss(m, batch)
        return loss.array
    return nnx.value_and_grad(loss_fn)(model)


def compiled_peak(compiled, platform: str) -> dict:
    """XLA's memory_analysis: on an accelerator its own peak (``peak_memory_in_bytes``) where
    reported, else (and on a CPU, whose peak leaves out the temporaries) arguments + outputs +
    temporaries, the split explain uses."""
    ma = compiled.memory_analysis()
    parts = {"arguments": ma.argument_size_in_bytes, "outputs": ma.output_size_in_bytes,
             "temporaries": ma.temp_size_in_bytes, "alias": ma.alias_size_in_bytes,
             "peak_memory_in_bytes": getattr(ma, "peak_memory_in_bytes", 0) or 0}
    total = parts["arguments"] + parts["outputs"] + parts["temporaries"]
    if platform != "cpu" and parts["peak_memory_in_bytes"]:
        return {"peak": parts["peak_memory_in_bytes"], "source": "peak_memory_in_bytes", **parts}
    return {"peak": total, "source": "arguments + outputs + temporaries", **parts}


def explained(mesh, layout, args):
    """md.explain's report of the explicit step, or None where it cannot read this jax's programs."""
    try:
        return md.explain(train_step, mesh, layout, *args)
    except Exception as e:  # noqa: BLE001 - the timings stand without it
        print(f"md.explain failed on jax {jax.__version__}: {type(e).__name__}: {e}", flush=True)
        return None


def step_row(cfg, batch: int, seq: int, mesh, layout, pairs: int, hardware, matmul_peak: float) -> dict:
    model = Llama(cfg, rngs=nnx.Rngs(0), dtype=jnp.bfloat16)
    args = (model, make_batch(cfg, batch, seq))
    placed = md.place(args, mesh, layout)
    runs = {b: md.lower(train_step, mesh, layout, backend=b) for b in ("explicit", "gspmd")}
    compiled, compile_s = {}, {}
    for b, f in runs.items():
        t = time.perf_counter()
        compiled[b] = f.compile(*placed)
        compile_s[b] = time.perf_counter() - t
    hlo = compiled["explicit"].as_text()
    times = alternate(runs, placed, pairs)
    med = {b: statistics.median(t) for b, t in times.items()}
    flops, tokens = model_flops(cfg, batch, seq), batch * seq
    row = {"case": f"{batch} x {seq}", "batch": batch, "seq": seq, "tokens": tokens,
           "explicit_s": med["explicit"], "gspmd_s": med["gspmd"], "ratio": med["explicit"] / med["gspmd"],
           "pairs": pairs, "samples": times, "compile_s": compile_s, "tokens_per_s": tokens / med["explicit"],
           "model_flops": flops, "tflops": flops / med["explicit"] / 1e12,
           "mfu_peak": flops / med["explicit"] / hardware.peak_flops("bfloat16"),
           "mfu_matmul": flops / med["explicit"] / matmul_peak,
           "attention_kernel": "cudnn" if "__cudnn$fmha" in hlo else "flash",
           "compiled_memory": compiled_peak(compiled["explicit"], mesh.platform)}
    report = explained(mesh, layout, args)
    if report is not None:
        t = report.time(hardware)
        row.update(explain_flops=report.flops, explain_memory={k: report.memory[k] for k in
                                                               ("arguments", "outputs", "temporaries", "peak")},
                   memory_ratio=report.memory["peak"] / row["compiled_memory"]["peak"],
                   predicted_s=t.total_s, predicted={"matmul_s": t.matmul_s, "memory_s": t.memory_s,
                                                     "communication_s": t.communication_s},
                   predicted_ratio=t.total_s / med["explicit"])
    del args, placed, runs, compiled, model
    gc.collect()
    return row


def attention_fn(implementation: str):
    """Forward and backward of causal md.attention (a weighted sum of its output as the loss)."""
    def step(q, k, v, g):
        def loss(q, k, v):
            o = md.attention(q, k, v, over="kv_seq", length="seq", features="d_head", causal=True,
                             implementation=implementation)
            return md.sum(o.astype(jnp.float32) * g).array
        return jax.value_and_grad(loss, argnums=(0, 1, 2))(q, k, v)
    return step


def attention_row(cfg, batch: int, seq: int, mesh, layout, pairs: int, gpu: bool) -> dict:
    dims = {"batch": batch, "seq": seq, "kv_seq": seq, "kv_heads": cfg.kv_heads, "groups": cfg.groups,
            "d_head": cfg.head_dim}
    keys = jax.random.split(jax.random.key(1), 4)

    def arg(key, names):
        shape = tuple(dims[n] for n in names.split())
        return md.named(jax.random.normal(key, shape, jnp.bfloat16), names)
    args = (arg(keys[0], "batch seq kv_heads groups d_head"), arg(keys[1], "batch kv_seq kv_heads d_head"),
            arg(keys[2], "batch kv_seq kv_heads d_head"), arg(keys[3], "batch seq kv_heads groups d_head"))
    placed = md.place(args, mesh, layout)
    row = {"case": f"{batch} x {seq}", "batch": batch, "seq": seq, "heads": cfg.heads, "d_head": cfg.head_dim,
           "flops": 6 * batch * seq ** 2 * cfg.heads * cfg.head_dim}
    runs = {"flash": md.lower(attention_fn("flash"), mesh, layout)}
    if not gpu:
        row["cudnn_note"] = f"cuDNN unavailable on {jax.devices()[0].platform}"
    else:
        try:
            cudnn = md.lower(attention_fn("cudnn"), mesh, layout)
            cudnn.compile(*placed)
            jax.block_until_ready(cudnn(*placed))   # compiled above: this runs it once
            runs = {"cudnn": cudnn, **runs}
        except Exception as e:  # noqa: BLE001 - recorded in the row; blockwise timed alone
            row["cudnn_note"] = f"cuDNN failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    for f in runs.values():
        f.compile(*placed)
    times = alternate(runs, placed, pairs)
    for k, t in times.items():
        row[f"{k}_s"] = statistics.median(t)
    row["samples"] = times
    row["ratio"] = row["cudnn_s"] / row["flash_s"] if "cudnn_s" in row else None
    del args, placed, runs
    gc.collect()
    return row


def _ms(s) -> str:
    return "n/a" if s is None else f"{s * 1e3:.2f}"


def _r(x, fmt=".3f") -> str:
    return "n/a" if x is None else format(x, fmt)


def _tf(flops_per_s: float) -> str:
    """TFLOP/s: one decimal, or three significant digits below 10 (a CPU's)."""
    t = flops_per_s / 1e12
    return f"{t:.1f}" if t >= 10 else f"{t:.3g}"


def run(quick: bool = False, pairs: int = 10, out: str | None = None) -> str:
    start = time.perf_counter()
    s = setup(quick)
    cfg, device = s["cfg"], jax.devices()[0]
    gpu = device.platform == "gpu"
    hardware = md.Hardware.profile(profile_name(device))
    matmul_peak = matmul_peak_flops(s["matmul"])
    peak = hardware.peak_flops("bfloat16")
    print(f"{device.device_kind}: bf16 matmul {s['matmul']}^3 {_tf(matmul_peak)} TFLOP/s, "
          f"profile {hardware.name} {_tf(peak)} TFLOP/s", flush=True)
    mesh, layout = md.Mesh({"data": 1}, devices=[device]), md.Layout({"batch": "data"})
    rows, attention = [], []
    for batch, seq in s["shapes"]:
        r = step_row(cfg, batch, seq, mesh, layout, pairs, hardware, matmul_peak)
        rows.append(r)
        print(f"step {r['case']:9s} explicit {_ms(r['explicit_s'])} ms  gspmd {_ms(r['gspmd_s'])} ms  "
              f"ratio {r['ratio']:.3f}  {_tf(r['tflops'] * 1e12)} TFLOP/s  MFU {r['mfu_peak']:.1%} "
              f"(matmul {r['mfu_matmul']:.1%})  predicted {_ms(r.get('predicted_s'))} ms  "
              f"memory explain/compiled {_r(r.get('memory_ratio'))}  "
              f"(compiled in {r['compile_s']['explicit']:.0f} + {r['compile_s']['gspmd']:.0f} s)", flush=True)
        a = attention_row(cfg, batch, seq, mesh, layout, pairs, gpu)
        attention.append(a)
        print(f"attention {a['case']:9s} cudnn {_ms(a.get('cudnn_s'))} ms  flash {_ms(a['flash_s'])} ms  "
              f"ratio {_r(a['ratio'])}  {a.get('cudnn_note', '')}", flush=True)
    columns = [("batch x seq", lambda r: r["case"]),
               ("explicit ms", lambda r: _ms(r["explicit_s"])), ("gspmd ms", lambda r: _ms(r["gspmd_s"])),
               ("explicit / gspmd", lambda r: f"{r['ratio']:.3f}"),
               ("tokens/s", lambda r: f"{r['tokens_per_s']:,.0f}"), ("TFLOP/s", lambda r: _tf(r["tflops"] * 1e12)),
               (f"MFU (peak {_tf(peak)})", lambda r: f"{r['mfu_peak']:.1%}"),
               (f"MFU (matmul {_tf(matmul_peak)})", lambda r: f"{r['mfu_matmul']:.1%}"),
               ("attention", lambda r: r["attention_kernel"])]
    memory_columns = [("batch x seq", lambda r: r["case"]),
                      ("explain peak", lambda r: fmt_bytes(r["explain_memory"]["peak"]) if "explain_memory" in r
                       else "n/a"),
                      ("compiled peak", lambda r: fmt_bytes(r["compiled_memory"]["peak"])),
                      ("explain / compiled", lambda r: _r(r.get("memory_ratio"))),
                      (f"predicted ms ({hardware.name})", lambda r: _ms(r.get("predicted_s"))),
                      ("measured ms", lambda r: _ms(r["explicit_s"])),
                      ("predicted / measured", lambda r: _r(r.get("predicted_ratio")))]
    attention_columns = [("batch x seq", lambda r: r["case"]), ("cuDNN ms", lambda r: _ms(r.get("cudnn_s"))),
                         ("blockwise ms", lambda r: _ms(r["flash_s"])), ("cuDNN / blockwise", lambda r: _r(r["ratio"])),
                         ("cuDNN TFLOP/s", lambda r: _tf(r["flops"] / r["cudnn_s"]) if "cudnn_s" in r else "n/a"),
                         ("blockwise TFLOP/s", lambda r: _tf(r["flops"] / r["flash_s"])),
                         ("note", lambda r: r.get("cudnn_note", ""))]
    source = rows[0]["compiled_memory"]["source"]
    notes = (f"{cfg.name} widths (d_model {cfg.d_model}, d_ff {cfg.d_ff}, {cfg.heads} heads, vocabulary "
             f"{cfg.vocab}), {cfg.layers} layers, bf16 compute, f32 parameters, one device (`batch:data`); loss and "
             f"gradients, medians of {pairs} alternating pairs after 2 warm-up runs each. TFLOP/s and MFU from the "
             f"analytic model FLOPs (6 N tokens + causal attention), against the {hardware.name} profile's bf16 peak "
             f"and the measured bf16 matmul ({s['matmul']}^3); `attention` is the kernel the compiled step runs.")
    if quick:
        notes = "**--quick (smoke test, not a measurement).** " + notes
    tables = [(f"**Memory (compiled: {source}) and predicted step time**", rows, memory_columns),
              ("**Attention alone (forward + backward, causal, bf16): cuDNN vs blockwise**", attention, attention_columns)]
    extra = {"quick": quick, "config": {k: getattr(cfg, k) for k in ("name", "d_model", "d_ff", "heads", "kv_heads",
                                                                      "vocab", "layers")},
             "profile": hardware.name, "profile_bf16_peak_flops": peak,
             "matmul_peak_flops": matmul_peak, "matmul_n": s["matmul"], "attention": attention,
             "seconds": time.perf_counter() - start}
    return write("gpu", rows, columns, "GPU: Llama-2-7B widths, one training step, explicit vs gspmd", notes=notes,
                 extra=extra, out=out, tables=tables)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny widths and sequences (a CPU smoke test)")
    p.add_argument("--pairs", type=int, default=None, help="alternating timed pairs (default 10, --quick 3)")
    p.add_argument("--out", default=None, help="directory for gpu.json and gpu.md (default bench/results)")
    a = p.parse_args(argv)
    if jax.devices()[0].platform != "gpu" and not a.quick:
        print(f"bench.gpu: no GPU here (jax sees {jax.devices()[0].platform}); run it on a GPU machine, "
              "or pass --quick for a CPU smoke test", file=sys.stderr)
        return 2
    start = time.perf_counter()
    print(run(a.quick, a.pairs or (3 if a.quick else 10), a.out))
    print(f"bench.gpu: {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
