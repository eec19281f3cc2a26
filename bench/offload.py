"""Offload: a training step with the optimizer state on the device or in host memory.

For each layout the training CLI runs ``--steps`` steps (AdamW, so the state is twice the
parameters) with the optimizer state on the device and with ``--offload optimizer``, twice each,
alternating, and the table gives the median step time of the steps after the first two, the
bytes per device that cross the host link each way per step, and the time those bytes take at
the host link's bandwidth (what the time model adds for the offload, the link measured on this
machine by ``Hardware.measure``), next to the time the offload added.

On CPU the "host" is the same DRAM: a transfer is a copy, and XLA's ``memory_analysis`` counts
host buffers with the device's (its host sizes read 0), so the device memory an offload frees
cannot be read here; the GPU table (a lent GPU) is where it shows.

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


def _run(out: str, steps: int, quick: bool, extra: list) -> dict:
    widths = "d_model=128,d_ff=512,heads=4,d_kv=32" if quick else "d_model=256,d_ff=1024,heads=8,d_kv=32"
    return main(["--override", widths, "--batch", "16", "--encoder-length", "64", "--optimizer", "adamw",
                 "--steps", str(steps), "--log-every", "1", "--no-explain", "--eval-batches", "0",
                 "--ckpt-every", "-1", "--out", out, "--overwrite", *extra])


def run(quick: bool = False, steps: int = 12) -> str:
    host = Hardware.measure(md.Mesh({"data": 8})).host_bandwidth
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, layout in LAYOUTS.items():
            times = {"device": [], "host": []}
            moved = 0.0
            for rep in range(2):
                for where, extra in (("device", []), ("host", ["--offload", "optimizer"])):
                    r = _run(f"{tmp}/{where}{rep}", steps, quick, layout + extra)
                    times[where] += [float(x["step_time_s"]) for x in r["records"][2:]]
                    if where == "host":
                        moved = r["trainer"].transfers(r["state"])[0]["bytes"]
            base, off = statistics.median(times["device"]), statistics.median(times["host"])
            predicted = 2 * moved / host
            for where, t in (("device", base), ("host", off)):
                rows.append({"layout": name, "optimizer state": where, "step_s": t, "vs_device": t / base,
                             "moved_each_way": moved if where == "host" else 0.0,
                             "added_s": t - base, "predicted_added_s": predicted if where == "host" else 0.0})
                print(f"{name:30s} {where:6s} {t * 1e3:8.1f} ms", flush=True)
    columns = [("layout", lambda r: r["layout"]), ("optimizer state", lambda r: r["optimizer state"]),
               ("step ms (median)", lambda r: f"{r['step_s'] * 1e3:.1f}"),
               ("vs on device", lambda r: f"{r['vs_device']:.3f}"),
               ("host link each way / device", lambda r: fmt_bytes(r["moved_each_way"]) if r["moved_each_way"] else "-"),
               ("added ms", lambda r: f"{r['added_s'] * 1e3:.2f}" if r["moved_each_way"] else "-"),
               ("predicted added ms (bytes both ways / host link)",
                lambda r: f"{r['predicted_added_s'] * 1e3:.2f}" if r["moved_each_way"] else "-")]
    return write("offload", rows, columns, "Offload: optimizer state on the device or in host memory",
                 notes=f"T5 ({'d_model 128' if quick else 'd_model 256'}), AdamW, batch 16 x 64/16, data:8, float32; "
                       f"median step time of steps 3-{steps} over two runs each, alternating; host link measured "
                       f"at {host / 1e9:.2f} GB/s. On CPU host memory is the same DRAM (see the module docstring).",
                 extra={"host_bandwidth": host})


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--steps", type=int, default=12)
    a = p.parse_args()
    print(run(a.quick, a.steps))
