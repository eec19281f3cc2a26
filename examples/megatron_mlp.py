"""``python examples/megatron_mlp.py``: a Megatron MLP under several layouts, explained and measured.

For each layout it prints what ``md.explain`` predicts (before compiling), then compiles, runs,
checks the result against the unsharded program, and prints the bytes the compiled HLO moves
(``meshdsl.costmodel.hlo_comm``) next to the prediction. Runs on 8 virtual CPU devices when no accelerator
has 8 devices.
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")

import argparse  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.costmodel import hlo_comm  # noqa: E402

LAYOUTS = {
    "data parallel": "batch:data",
    "Megatron": "batch:data;d_ff:model",
    "2-D weight-stationary": "d_model:data;d_ff:model",
    "ZeRO-3": "batch:data | d_model:data",
}


def mlp(x, w1, w2):
    """y = relu(x w1) w2 over named dims."""
    h = md.relu(md.einsum(x, w1, out="batch seq d_ff"))
    return md.einsum(h, w2, out="batch seq d_model")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mesh", default="data:2;model:4")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--d-ff", type=int, default=1024)
    a = p.parse_args(argv)
    mesh = md.Mesh.parse(a.mesh)
    k = jax.random.split(jax.random.key(0), 3)
    x = md.named(jax.random.normal(k[0], (a.batch, a.seq, a.d_model)), "batch seq d_model")
    w1 = md.param(md.named(jax.random.normal(k[1], (a.d_model, a.d_ff)) * a.d_model ** -0.5, "d_model d_ff"))
    w2 = md.param(md.named(jax.random.normal(k[2], (a.d_ff, a.d_model)) * a.d_ff ** -0.5, "d_ff d_model"))
    reference = np.asarray(mlp(x, w1, w2).array)
    print(f"mesh {mesh}; x [{x.dims}], w1 [{w1.dims}], w2 [{w2.dims}]\n")
    for name, spec in LAYOUTS.items():
        rules, _, params = spec.partition("|")
        layout = md.Layout.parse(rules, params=params.strip() or None)
        report = md.explain(mlp, mesh, layout, x, w1, w2)
        f = md.lower(mlp, mesh, layout)
        out = np.asarray(f(x, w1, w2).array)
        measured = hlo_comm.analyze(f.lower(x, w1, w2).compile()).total_moved_bytes()
        print(f"## {name}: {layout}")
        print(report.to_markdown())
        print(f"\ncompiled HLO moves {measured:.0f} B per device (predicted {report.total_bytes:.0f} B); "
              f"max |error| vs unsharded = {np.abs(out - reference).max():.2e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
