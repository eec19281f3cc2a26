"""Long context: the longest sequence one training step fits in a fixed memory per device, under
each way of placing it, and the bytes each moves against its analytic minimum.

A causal decoder stack (pre-norm attention with no position bias, a gated feed-forward, both
scanned over ``layers``) of two widths - ``t5-small`` (d_model 512, 8 heads of 64, d_ff 2048) and
``llama-tiny`` (the Llama config's widths) - one sequence of ``seq`` positions, loss and
gradients, on 8 devices:

* ``whole sequence``: no split (each device holds the sequence; data parallel's memory per
  sequence: a data-parallel group gives a device one sequence whole);
* ``gather`` / ``ulysses`` / ``ring``: ``seq: ctx`` over 8 devices, ``md.lower(attention=...)``.

For each, the longest power-of-two length whose ``md.explain`` peak fits ``--budget`` (shapes only,
on an abstract mesh), then at ``--check`` positions the compiled program: its temporaries
(``memory_analysis``) next to explain's, and its bytes (``hlo_comm``) next to explain's and the
analytic minimum of the strategy (:func:`analytic_minimum`) and the compiler's (``backend="gspmd"``,
the same program and layout).

Run: ``python -m bench.context [--quick]`` (writes bench/results/context.{json,md}).
"""

from __future__ import annotations

import argparse

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
import meshdsl.layers as L  # noqa: E402
from bench.common import hlo_bytes, ratio, total, write  # noqa: E402
from meshdsl.names.named import is_named  # noqa: E402
from meshdsl.names.units import fmt_bytes  # noqa: E402

WIDTHS = {   # d_model, heads, d_kv, d_ff, layers
    "t5-small": (512, 8, 64, 2048, 2),
    "llama-tiny": (64, 4, 16, 176, 2),
}
CASES = {   # name: (layout rules, md.lower's attention=)
    "whole sequence": ({}, None),
    "gather": ({"seq": "ctx"}, "gather"),
    "ulysses": ({"seq": "ctx"}, "ulysses"),
    "ring": ({"seq": "ctx"}, "ring"),
}
DEVICES = 8


class Decoder(nnx.Module):
    """Pre-norm causal self-attention and a gated SiLU feed-forward, ``layers`` stacked."""

    def __init__(self, d_model, heads, d_kv, d_ff, layers, *, rngs):
        stack = md.Dim("layers", layers)
        dm = md.Dim("d_model", d_model)
        self.attention_norm = L.RMSNorm(dm, stack=stack)
        self.attention = L.Attention(dm, md.Dim("heads", heads), md.Dim("d_kv", d_kv), rngs=rngs, causal=True,
                                     relative_bias=False, stack=stack)
        self.ffn_norm = L.RMSNorm(dm, stack=stack)
        self.ffn = L.FeedForward(dm, md.Dim("d_ff", d_ff), rngs=rngs, activation="gated-silu", stack=stack)

    def __call__(self, x):
        def step(layer, x, _):
            x = x + layer.attention(layer.attention_norm(x))[0]
            return x + layer.ffn(layer.ffn_norm(x)), None
        return L.scan_layers(self, x, step)[0]


def train_step(graphdef):
    def step(params, x):
        def loss(p):
            return md.mean(md.square(nnx.merge(graphdef, p)(x))).array
        return jax.grad(loss)(params)
    return step


def build(width: str, seq: int, abstract: bool):
    d_model, heads, d_kv, d_ff, layers = WIDTHS[width]
    make = lambda: Decoder(d_model, heads, d_kv, d_ff, layers, rngs=nnx.Rngs(0))  # noqa: E731
    model = nnx.eval_shape(make) if abstract else make()
    graphdef, params = nnx.split(model)
    shape = (1, seq, d_model)
    x = jax.ShapeDtypeStruct(shape, jnp.float32) if abstract else jax.random.normal(jax.random.key(1), shape)
    return train_step(graphdef), params, md.named(x, "batch seq d_model")


def peak(width, case, seq, mesh) -> float:
    rules, attention = CASES[case]
    step, params, x = build(width, seq, abstract=True)
    return md.explain(step, mesh, md.Layout(rules), params, x, attention=attention).memory["peak"]


def longest(width, case, budget, lengths) -> int | None:
    """The longest of ``lengths`` whose step fits ``budget`` bytes per device (explain, shapes only)."""
    mesh = md.Mesh.abstract({"ctx": DEVICES})
    best = None
    for seq in lengths:
        if peak(width, case, seq, mesh) > budget:
            break
        best = seq
    return best


def check(width, case, seq) -> dict:
    """The compiled program at ``seq`` positions: memory and bytes, with explain's and the minimum."""
    rules, attention = CASES[case]
    mesh, layout = md.Mesh({"ctx": DEVICES}), md.Layout(rules)
    step, params, x = build(width, seq, abstract=False)
    report = md.explain(step, mesh, layout, params, x, attention=attention)
    compiled = report.compiled_memory()
    measured = hlo_bytes(md.lower(step, mesh, layout, attention=attention), params, x)
    gspmd = hlo_bytes(md.lower(step, mesh, layout, backend="gspmd"), params, x)
    weights = sum(p.size * 4 for p in jax.tree_util.tree_leaves(params, is_leaf=is_named) if is_named(p))
    minimum = analytic_minimum(width, case, seq, weights)
    return {"explain_temporaries": report.memory["temporaries"], "compiled_temporaries": compiled["temporaries"],
            "explain_bytes": report.total_bytes, "compiled_bytes": total(measured), "minimum_bytes": minimum,
            "gspmd_bytes": total(gspmd),
            "strategy": [a["strategy"] for a in report.attention]}


def analytic_minimum(width, case, seq, weights) -> float:
    """Bytes per device the placement cannot avoid: the weights' gradients all-reduced over
    ``ctx`` (``2 (n-1)/n |W|``), and per layer the strategy's own - ring: the chunks of keys and
    values ``(n-1)`` times forward and ``2 (n-1)`` backward (their gradients ride along); gather:
    the cheaper of the keys and values or the layer's input (``d_model`` wide) gathered, and its
    gradient reduce-scattered; Ulysses: ``(n-1)/n`` of q, k, v and the result, each way."""
    if case == "whole sequence":
        return 0.0
    d_model, heads, d_kv, _, layers = WIDTHS[width]
    n = DEVICES
    chunk = seq // n * heads * d_kv * 4           # one device's keys (or values)
    x = seq // n * d_model * 4                    # one device's layer input
    per_layer = {"ring": 3 * (n - 1) * 2 * chunk, "gather": 2 * (n - 1) * min(x, 2 * chunk),
                 "ulysses": 2 * (n - 1) / n * 4 * chunk}[case]
    return 2 * (n - 1) / n * weights + layers * per_layer


def run(quick: bool = False, budget_mib: int = 1024, check_seq: int | None = None) -> str:
    lengths = [2 ** k for k in range(10, 15 if quick else 20)]
    check_seq = check_seq or (2048 if quick else 4096)
    rows = []
    for width in WIDTHS:
        for case in CASES:
            try:
                found = longest(width, case, budget_mib * 2 ** 20, lengths)
                row = {"width": width, "case": case, "longest": found, **check(width, case, check_seq)}
            except md.ShapeError as e:   # Ulysses with fewer heads than devices
                row = {"width": width, "case": case, "longest": None, "refused": str(e).split(": ", 1)[1][:90]}
            rows.append(row)
            print(row, flush=True)
    whole = {r["width"]: r["longest"] or 0 for r in rows if r["case"] == "whole sequence"}
    def cell(key, fmt):
        return lambda r: "n/a" if "refused" in r else fmt(r)

    columns = [
        ("width", lambda r: r["width"]), ("placement", lambda r: r["case"]),
        ("longest seq in budget", lambda r: "refused: too few heads" if "refused" in r
         else r["longest"] or f"< {lengths[0]}"),
        ("x whole", cell("longest", lambda r: ratio(r["longest"] or 0, whole[r["width"]]))),
        (f"temporaries @ {check_seq}: explain / compiled", cell("t", lambda r: (
            f"{fmt_bytes(r['explain_temporaries'])} / {fmt_bytes(r['compiled_temporaries'])}"))),
        ("bytes: compiled", cell("b", lambda r: fmt_bytes(r["compiled_bytes"]))),
        ("explain / compiled", cell("e", lambda r: ratio(r["explain_bytes"], r["compiled_bytes"]))),
        ("compiled / minimum", cell("m", lambda r: ratio(r["compiled_bytes"], r["minimum_bytes"]))),
        ("compiled / gspmd", cell("g", lambda r: ratio(r["compiled_bytes"], r["gspmd_bytes"]))),
    ]
    notes = (f"Budget {budget_mib} MiB per device (explain's peak: arguments, outputs and temporaries), "
             f"lengths {lengths[0]}..{lengths[-1]} (powers of two), 8 devices on `ctx`, one sequence, "
             f"loss and gradients of 2 layers. Bytes and temporaries at {check_seq} positions, compiled on "
             "this machine's CPU devices; minimum: `analytic_minimum` (the strategy's own bytes per layer + the "
             "weights' gradient all-reduce).")
    return write("context", rows, columns, "Long context: longest sequence per placement, and bytes", notes,
                 extra={"budget_mib": budget_mib, "check_seq": check_seq})


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--budget-mib", type=int, default=1024)
    ap.add_argument("--check-seq", type=int, default=None)
    a = ap.parse_args()
    print(run(a.quick, a.budget_mib, a.check_seq))
