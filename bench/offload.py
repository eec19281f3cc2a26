"""Offload: a training step with the optimizer state, and the parameters, on the device or in host memory.

For each layout the training CLI runs ``--steps`` steps (AdamW, so the state is twice the
parameters) with everything on the device, with ``--offload optimizer`` and with ``--offload
params,optimizer`` (each layer's parameters streamed to the device where used), twice each,
alternating, and the table gives the median step time of the steps after the first two, the
device peak and the host memory per device ``md.explain`` predicts for the step's loss and
gradients (the parameters' and the optimizer state's bytes in host memory added to its host
figure), the bytes per device that cross the host link per step (both ways: the trainer's
``transfers``), and the time those bytes take at the host link's bandwidth (what the search adds
for the offload, the link measured on this machine by ``Hardware.measure``), next to the time the
offload added.

On CPU the "host" is the same DRAM: a transfer is a copy, and XLA's ``memory_analysis`` counts
host buffers with the device's (its host sizes read 0), so the compiled device memory an offload
frees cannot be read here (explain's is given); the GPU table (a lent GPU) is where it shows.
What can be read is the whole: the compiled loss-and-gradients program's arguments, outputs and
temporaries, host buffers included, against explain's device peak plus host memory for it.

Run: ``python -m bench.offload [--quick]`` (writes bench/results/offload.{json,md}).
"""

from __future__ import annotations

from bench import common  # noqa: F401 - sets up devices first

import argparse  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import meshdsl as md  # noqa: E402
from bench.common import write  # noqa: E402
from meshdsl.costmodel.hardware import Hardware  # noqa: E402
from meshdsl.models.cli.train import main  # noqa: E402
from meshdsl.names.units import fmt_bytes  # noqa: E402

LAYOUTS = {"data parallel": [], "ZeRO-3 (params d_model:data)": ["--params-layout", "d_model:data"]}
CHOICES = {"device": [], "optimizer": ["--offload", "optimizer"], "params, optimizer": ["--offload", "params,optimizer"]}


def _run(out: str, steps: int, quick: bool, extra: list) -> dict:
    widths = "d_model=128,d_ff=512,heads=4,d_kv=32" if quick else "d_model=256,d_ff=1024,heads=8,d_kv=32"
    return main(["--override", widths, "--batch", "16", "--encoder-length", "64", "--optimizer", "adamw",
                 "--steps", str(steps), "--log-every", "1", "--eval-batches", "0",
                 "--ckpt-every", "-1", "--out", out, "--overwrite", *extra])


def run(quick: bool = False, steps: int = 12) -> str:
    host = Hardware.measure(md.Mesh({"data": 8})).host_bandwidth
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            times, seen = {c: [] for c in CHOICES}, {}
            for rep in range(2):
                for choice, extra in CHOICES.items():
                    r = _run(f"{tmp}/{rep}{len(seen)}", steps, quick, layout + extra)
                    times[choice] += [float(x["step_time_s"]) for x in r["records"][2:]]
                    seen[choice] = _memory(r)
            base = statistics.median(times["device"])
            for choice in CHOICES:
                t = statistics.median(times[choice])
                memory = seen[choice]
                rows.append({"layout": name, "offload": choice, "step_s": t, "vs_device": t / base, **memory,
                             "added_s": t - base, "predicted_added_s": memory["moved"] / host})
                print(f"{name:30s} {choice:18s} {t * 1e3:8.1f} ms", flush=True)
    columns = [("layout", lambda r: r["layout"]), ("in host memory", lambda r: r["offload"]),
               ("step ms (median)", lambda r: f"{r['step_s'] * 1e3:.1f}"),
               ("vs on device", lambda r: f"{r['vs_device']:.3f}"),
               ("device peak / device (explain)", lambda r: fmt_bytes(r["device_peak"])),
               ("host memory / device", lambda r: fmt_bytes(r["host"]) if r["host"] else "-"),
               ("compiled (XLA:CPU, host included)", lambda r: fmt_bytes(r["compiled"])),
               ("explain / compiled", lambda r: f"{r['explained'] / r['compiled']:.3f}"),
               ("host link per step / device (both ways)", lambda r: fmt_bytes(r["moved"]) if r["moved"] else "-"),
               ("added ms", lambda r: f"{r['added_s'] * 1e3:.2f}" if r["moved"] else "-"),
               ("predicted added ms (bytes / host link)",
                lambda r: f"{r['predicted_added_s'] * 1e3:.2f}" if r["moved"] else "-")]
    return write("offload", rows, columns, "Offload: optimizer state and parameters on the device or in host memory",
                 notes=f"T5 ({'d_model 128' if quick else 'd_model 256'}), AdamW, batch 16 x 64/16, data:8, float32; "
                       f"median step time of steps 3-{steps} over two runs each, alternating; host link measured "
                       f"at {host / 1e9:.2f} GB/s. Device peak: explain's for the loss-and-gradients program, plus "
                       f"the optimizer state where it stays on the device. On CPU host memory is the same DRAM (see "
                       f"the module docstring); explain / compiled compares the loss-and-gradients program's "
                       f"device peak plus host memory with what XLA:CPU allocates for it, host buffers included.",
                 extra={"host_bandwidth": host})


def _memory(r) -> dict:
    """Device peak and host bytes per device (explain's, the state's and parameters' added where
    they live) and the bytes the step moves over the host link, both ways."""
    trainer, state, report = r["trainer"], r["state"], r["report"]
    opt, offload = trainer.bytes_per_device(state, "opt_state"), trainer.layout.offload
    device = report.memory["peak"] + (0.0 if "optimizer" in offload else opt)
    host = report.memory.get("host", 0.0) + (opt if "optimizer" in offload else 0.0)
    compiled = report.compiled_memory()   # the loss-and-gradients program's, host buffers among its own
    return {"device_peak": device, "host": host, "moved": sum(t["bytes"] for t in trainer.transfers(state, report=report)),
            "compiled": compiled["arguments"] + compiled["outputs"] + compiled["temporaries"],
            "explained": report.memory["peak"] + report.memory.get("host", 0.0)}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    print(run(a.quick, a.steps))
