"""A whole training step written in named ops: bytes against the data-parallel minimum (issue 9).

The step takes the model, Adam's moments and a batch; computes the loss and gradients inside the
lowered function, then the Adam update in named ops, and returns the new parameters and moments
(marked as parameters, so the storage rules place them). Layouts, t5-small widths:

* **data parallel** (``batch:data``): the only communication a step needs is the gradient sum,
  ``2(n-1)/n * 4 Psi`` bytes per device (+ the loss scalar); no all-reduce to fix the type of the
  updated parameters or moments (they are computed from replicated values alone).
* **ZeRO-3 storage** (``params d_model:data``: parameters and moments stored split): a
  reduce-scatter of the gradients and an all-gather of the parameters at use, ``(n-1)/n * 4 Psi``
  each for the split ones - the same total (the ZeRO paper's 2 Psi elements); parameters without
  ``d_model`` stay replicated and their gradients are all-reduced.

Run: ``python -m bench.fused_step [--layers N]`` (writes bench/results/fused_step.{json,md}).
"""

from __future__ import annotations

from bench import common  # noqa: F401 - sets up devices first

import argparse  # noqa: E402


import meshdsl as md  # noqa: E402
from bench.common import fmt_kinds, measure, ratio, total, write  # noqa: E402
from bench.models import F32, batch_for, build, config, param_leaves, shapes, train_step  # noqa: E402

LAYOUTS = {
    "data parallel": (md.Layout({"batch": "data"}), None),
    "ZeRO-3 storage (params and moments)": (md.Layout({"batch": "data"}, params={"d_model": "data"}), "d_model"),
}


def fused_adam(model, m, v, batch, lr=1e-3, b1=0.9, b2=0.99, eps=1e-8):
    """One Adam step in named ops (bias correction folded into ``lr``): loss, new parameters and
    moments, all returned."""
    loss, grads = train_step(model, batch)
    g, p = param_leaves(grads), param_leaves(model)
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * md.square(gi) for vi, gi in zip(v, g)]
    p = [pi - lr * mi / (md.sqrt(vi) + eps) for pi, mi, vi in zip(p, m, v)]
    return loss, [md.param(t) for t in p], [md.param(t) for t in m], [md.param(t) for t in v]


def minimum(params, n: int, split_dim: str | None) -> tuple[float, str]:
    """Bytes one device must send: every gradient summed over ``data`` (an all-reduce, or a
    reduce-scatter plus the all-gather of the parameter for parameters stored split: the same
    bytes), plus the loss scalar."""
    psi = sum(p.size for p in params)
    grads = 2 * (n - 1) / n * F32 * psi
    return grads + 2 * (n - 1) / n * F32, f"2(n-1)/n * 4 Psi + loss, Psi = {psi:,} parameters"


def run(quick: bool = True, layers: int = 2) -> str:
    cfg = config("dense", layers, quick)
    s = shapes(quick)
    model = build(cfg)
    batch = batch_for(cfg, s["batch"], s["enc"], s["dec"])
    params = param_leaves(model)
    zeros = [md.param(p * 0.0) for p in params]
    mesh = md.Mesh({"data": 8})
    rows = []
    for name, (layout, split_dim) in LAYOUTS.items():
        m = measure(fused_adam, mesh, layout, model, zeros, zeros, batch)
        lo, formula = minimum(params, 8, split_dim)
        rows.append({"layout": name, "rules": str(layout).replace("|", "\\|"), "explicit": fmt_kinds(m["explicit"]),
                     "explicit_bytes": total(m["explicit"]), "explain_bytes": total(m["explain"]),
                     "gspmd": fmt_kinds(m["gspmd"]), "gspmd_bytes": total(m["gspmd"]), "minimum_bytes": lo,
                     "formula": formula,
                     "explain_exact": {k: v["bytes"] for k, v in m["explain"].items()} ==
                     {k: v["bytes"] for k, v in m["explicit"].items()},
                     "vs_minimum": f"{total(m['explicit']) / lo:.4f}",
                     "vs_gspmd": ratio(total(m["explicit"]), total(m["gspmd"]))})
        print(rows[-1], flush=True)
    keys = [("layout", "layout"), ("rules", "rules"), ("explicit", "explicit"), ("explicit B", "explicit_bytes"),
            ("gspmd", "gspmd"), ("gspmd B", "gspmd_bytes"), ("minimum B", "minimum_bytes"), ("formula", "formula"),
            ("explain = HLO", "explain_exact"), ("explicit / minimum", "vs_minimum"), ("explicit / gspmd", "vs_gspmd")]
    columns = [(title, lambda r, k=k: f"{r[k]:.0f}" if isinstance(r[k], float) else r[k]) for title, k in keys]
    return write("fused_step", rows, columns,
                 f"Fused Adam training step in named ops, t5-small widths, {layers}+{layers} layers, data:8",
                 notes="Loss, gradients and the Adam update inside one md.lower'ed function; "
                       "bytes per device per step from the compiled HLO (hlo_comm).")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--full", action="store_true", help="longer sequences (default: the quick shapes)")
    a = p.parse_args()
    print(run(not a.full, a.layers))
