"""Memory per device: compiled ``memory_analysis()`` vs ``md.explain``'s estimate vs the ZeRO formulas.

One training step with an Adam update inside the lowered program (parameters P, their gradients,
first and second moments: all float32), t5-small widths with 2 + 2 layers, on 8 devices:

=============  ============================================  =====================================
layout         what is split                                 model states per device (Rajbhandari
                                                             et al., fp32 Adam, Psi parameters)
=============  ============================================  =====================================
data parallel  nothing (batch only)                          16 Psi
ZeRO-1         optimizer moments (``md.param``, stored        4 Psi + 4 Psi + 8 Psi / N
               over data by ``params={"d_model": "data"}``)
ZeRO-3         parameters and moments, over data              16 Psi / N  (gradients reduce-scattered)
Megatron       heads, d_ff, vocab over model (M = 4)         ~16 Psi / M for the split parameters
=============  ============================================  =====================================

"arguments" are what the step reads (parameters and moments, and the batch), "temporaries" what it
allocates (gradients, activations). On CPU ``memory_analysis().peak_memory_in_bytes`` is only
arguments + outputs, so temporaries are read from ``temp_size_in_bytes``.

Run: ``python -m bench.memory [--quick]`` (writes bench/results/memory.{json,md}).
"""

from __future__ import annotations

import argparse

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from bench import models  # noqa: E402
from bench.common import write  # noqa: E402
from meshdsl.models.loss import t5_loss  # noqa: E402
from meshdsl.models.t5 import count_params  # noqa: E402
from meshdsl.names.named import is_named  # noqa: E402

CASES = {  # name: (mesh, rules, params rules, parameters marked md.param)
    "data parallel": ("data:8", {"batch": "data"}, None, True),
    "ZeRO-1": ("data:8", {"batch": "data"}, {"d_model": "data"}, False),
    "ZeRO-3": ("data:8", {"batch": "data"}, {"d_model": "data"}, True),
    "Megatron": ("data:2;model:4", models.MEGATRON, None, True),
}


def adam_step(graphdef, params_marked: bool):
    """Loss, gradients and an Adam update, all inside the lowered program."""
    mark = md.param if params_marked else (lambda x: x)

    def step(params, m, v, batch):
        def loss_fn(p):
            return t5_loss(nnx.merge(graphdef, p), batch, train=True)[0].array
        loss, g = jax.value_and_grad(loss_fn)(params)
        tree = jax.tree_util.tree_map
        m = tree(lambda m, g: md.param(0.9 * m + 0.1 * g), m, g, is_leaf=is_named)
        v = tree(lambda v, g: md.param(0.999 * v + 0.001 * g * g), v, g, is_leaf=is_named)
        params = tree(lambda p, m, v: mark(p - 1e-3 * m / (md.sqrt(v) + 1e-8)), params, m, v, is_leaf=is_named)
        return params, m, v, loss
    return step


def formula(name: str, psi: int, n: int) -> float:
    return {"data parallel": 16 * psi, "ZeRO-1": 8 * psi + 8 * psi / n, "ZeRO-3": 16 * psi / n,
            "Megatron": None}[name]


def run(quick: bool = False) -> str:
    cfg = models.config("dense", 2, quick)
    s = models.shapes(quick)
    graphdef, state = nnx.split(models.build(cfg, abstract=True))
    batch = models.batch_for(cfg, s["batch"], s["enc"], s["dec"], abstract=True)
    psi = count_params(cfg)
    rows = []
    for name, (mesh_spec, rules, prules, marked) in CASES.items():
        mesh, layout = md.Mesh.parse(mesh_spec), md.Layout(rules, params=prules)
        tree = jax.tree_util.tree_map
        params = tree(lambda p: p if marked else md.NamedArray(p.raw, p.dims), state, is_leaf=is_named)
        moments = tree(lambda p: md.param(md.NamedArray(p.raw, p.dims)), state, is_leaf=is_named)
        step = adam_step(graphdef, marked)
        args = (params, moments, moments, batch)
        ma = md.lower(step, mesh, layout).lower(*args).compile().memory_analysis()
        est = md.explain(step, mesh, layout, *args).memory
        # model states per device as the formula counts them: what the step reads, plus gradients
        rows.append({"layout": name, "mesh": str(mesh), "psi": psi,
                     "arguments": ma.argument_size_in_bytes, "temporaries": ma.temp_size_in_bytes,
                     "explain_arguments": est["arguments"], "explain_temporaries": est["temporaries"],
                     "explain_peak": est["peak"], "formula_model_states": formula(name, psi, 8)})
        r = rows[-1]
        print(f"{name:14s} args {r['arguments'] / 2**20:8.1f} MiB (explain {r['explain_arguments'] / 2**20:8.1f})  "
              f"temp {r['temporaries'] / 2**20:8.1f} MiB (explain {r['explain_temporaries'] / 2**20:8.1f})", flush=True)
    mib = lambda b: "-" if b is None else f"{b / 2**20:.1f}"  # noqa: E731
    columns = [("layout", lambda r: r["layout"]), ("mesh", lambda r: r["mesh"]),
               ("arguments MiB (compiled)", lambda r: mib(r["arguments"])),
               ("arguments MiB (explain)", lambda r: mib(r["explain_arguments"])),
               ("temporaries MiB (compiled)", lambda r: mib(r["temporaries"])),
               ("temporaries MiB (explain)", lambda r: mib(r["explain_temporaries"])),
               ("ZeRO formula: model states MiB", lambda r: mib(r["formula_model_states"])),
               ("compiled args + grads MiB", lambda r: mib(r["arguments"] + _grad_bytes(r)))]
    return write("memory", rows, columns, "Memory per device: one training step with Adam",
                 notes=f"t5-small widths, 2 + 2 layers, Psi = {psi:,} parameters, float32; batch {s['batch']}, "
                       f"{s['enc']} / {s['dec']} tokens. 'args + grads' adds the gradients' share (as the "
                       "layout stores them) to the compiled arguments, to compare with the formula.")


def _grad_bytes(r) -> float:
    n = 8
    return {"data parallel": 4 * r["psi"], "ZeRO-1": 4 * r["psi"], "ZeRO-3": 4 * r["psi"] / n}.get(r["layout"], 0.0)


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true")
    print(run(p.parse_args().quick))
