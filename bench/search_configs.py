"""``md.search``'s choice next to the layouts T5X and MaxText configure, for one model and machine.

t5-v1_1-xxl (11B parameters, float32 weights, remat full) trained with T5X's pretraining batch
(2048 sequences of 512 / 128 tokens) on 256 H100-80GB (the ``h100-80gb`` profile: 8 per host on
NVLink, hosts on the network). Nothing is compiled: every row is ``md.explain`` on an abstract mesh
and the time model, as the search costs its candidates.

The configured layouts, written as meshdsl layouts:

* **T5X, 1D parameter partitioning** (``t5x.partitioning.standard_logical_axis_rules()``'s
  default: ``batch -> data``; ``mlp``, ``heads``, ``vocab`` -> ``model``; Megatron) with a
  model-parallel submesh of 8 devices (``PjitPartitioner.model_parallel_submesh=(1, 1, 8, 1)``);
* **T5X, 2D parameter partitioning** (``parameter_partitioning_dims=2``: also ``embed -> data`` for
  the weights, stored split and gathered where used: ZeRO-3 over ``data``);
* **T5X, data parallel** (``num_partitions=1``, the default of its pretraining runs);
* **MaxText, FSDP** (its default ``ici_fsdp_parallelism=-1``: the batch and every weight's
  ``embed`` dim over all devices).

Run: ``python -m bench.search_configs`` (writes bench/results/search_configs.{json,md}).
"""

from __future__ import annotations

import argparse
import time

from bench import common  # noqa: F401 - sets up devices first

from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from bench.common import write  # noqa: E402
from meshdsl.models.configs import get_config  # noqa: E402
from meshdsl.models.autolayout import abstract_batch, step_of  # noqa: E402
from meshdsl.models.t5 import T5  # noqa: E402
from meshdsl.names.units import fmt_bytes  # noqa: E402

DEVICES, HARDWARE = 256, "h100-80gb"
MEGATRON = {"batch": "data", "heads": "model", "d_ff": "model", "vocab": "model"}
CONFIGURED = {   # name: (mesh shape, layout)
    "T5X, 1D parameter partitioning (model submesh 8)": ({"data": 32, "model": 8}, md.Layout(MEGATRON)),
    "T5X, 2D parameter partitioning (model submesh 8)": ({"data": 32, "model": 8},
                                                          md.Layout(MEGATRON, params={"d_model": "data"})),
    "T5X, data parallel (num_partitions=1)": ({"data": DEVICES}, md.Layout({"batch": "data"})),
    "MaxText, FSDP over all devices": ({"data": DEVICES}, md.Layout({"batch": "data"}, params={"d_model": "data"})),
}


def _step(batch: int, inputs: int = 512, targets: int = 128):
    """The t5-v1_1-xxl training step (remat full) the training CLI's ``--layout auto`` searches, abstract."""
    model = nnx.eval_shape(lambda: T5(get_config("t5-v1_1-xxl").replace(dropout_rate=0.0), rngs=nnx.Rngs(0)))
    return step_of("full"), model, abstract_batch(batch, inputs, targets)


def run(quick: bool = False) -> str:
    step, model, data = _step(2048)
    hw = md.Hardware.profile(HARDWARE)
    t0 = time.perf_counter()
    result = md.search(step, DEVICES, model, data, hardware=hw, zero=True, top=1000,
                       dims=["batch", "heads", "d_ff"] if quick else ["batch", "heads", "d_ff", "vocab", "d_model"])
    seconds = time.perf_counter() - t0
    best = result.best
    rows = [_row("md.search's choice", best, result, best.time)]
    rows += [_row("md.search, second", result[1], result, best.time)] if len(result) > 1 else []
    for name, (shape, layout) in CONFIGURED.items():
        mesh = md.Mesh.abstract(shape)
        report = md.explain(step, mesh, layout, model, data, hardware=hw)   # planned and priced as the search does:
        t = report.time(hw, dtype=None)                                      # each kernel at its own dtype
        rows.append({"source": name, "mesh": str(mesh), "layout": str(layout), "predicted_s": t.total_s,
                     "vs_best": t.total_s / best.time, "bytes": report.total_bytes, "peak_bytes": report.memory["peak"],
                     "fits": report.memory["peak"] * 1.1 <= hw.memory_bytes,
                     "rank": _rank(result, mesh, layout)})
    notes = (f"t5-v1_1-xxl train step (remat full, float32 weights), batch 2048 x 512/128, on {DEVICES} x {HARDWARE} "
             f"(profile), from shapes alone. The search ({result.costed} layouts costed in {seconds:.0f} s, ZeRO-3 "
             "storage tried) against the layouts T5X's and MaxText's configurations give the same model; "
             "`fits`: peak + 10% within the 80 GB. `rank`: the configured layout's place in the search's ranking "
             "(`-`: not among its candidates, or rejected).")
    return write("search_configs", rows, [
        ("source", lambda r: r["source"]), ("mesh", lambda r: r["mesh"]), ("layout", lambda r: f"`{r['layout']}`"),
        ("step (predicted)", lambda r: f"{r['predicted_s'] * 1e3:.0f} ms"),
        ("x search's choice", lambda r: f"{r['vs_best']:.2f}"),
        ("bytes/device", lambda r: fmt_bytes(r["bytes"])), ("peak memory/device", lambda r: fmt_bytes(r["peak_bytes"])),
        ("fits", lambda r: "yes" if r["fits"] else "**no**"), ("rank", lambda r: r["rank"] or "-")],
        "md.search next to the T5X and MaxText layouts (t5-v1_1-xxl, 256 H100s)", notes,
        extra={"search_seconds": seconds, "costed": result.costed, "hardware": HARDWARE, "devices": DEVICES})


def _row(source, cand, result, best_time) -> dict:
    return {"source": source, "mesh": str(cand.mesh), "layout": cand.describe(), "predicted_s": cand.time,
            "vs_best": cand.time / best_time, "bytes": cand.total_bytes, "peak_bytes": cand.memory["peak"],
            "fits": True, "rank": list(result).index(cand) + 1}


def _rank(result, mesh, layout):
    for i, c in enumerate(result):
        if c.mesh.shape == mesh.shape and c.layout.rules == layout.rules and c.layout.param_rules == layout.param_rules:
            return i + 1
    return None


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="search batch, heads and d_ff only")
    print(run(p.parse_args().quick))
