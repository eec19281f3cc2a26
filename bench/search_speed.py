"""How long ``md.search`` takes: t5-v1_1-xxl on 512 devices and llama-3-8b on 64, given as counts.

The training step of ``bench.search_configs`` (remat full, float32 weights) with a batch of 1024
sequences of 512 / 128 tokens, searched over every factorisation of 512 into ``data`` or
``data x model`` on the ``h100-80gb`` profile, for three sets of dims: the three a T5 user splits
first (batch, heads, d_ff) and five (adding vocab and d_model), ranking every layout (``top=1000``),
and every dim the program has (the default) keeping the best ten (``top=10``, the default: layouts
whose compute floor is over the tenth's step are not costed); and llama-3-8b's training step
(batch 16 x 32768 tokens, remat full, 80 GB, 64 devices, every dim, ``top=10``). Reported per search: the layouts
enumerated, how many were pruned or rejected before tracing, traced (``costed``), retimed (the
program of a traced layout under other axis names), the seconds, and the seconds per traced
layout. Nothing is compiled. "rejected before tracing" counts the layouts pruned (axes that do not
divide a dim), those whose arguments and outputs alone are over the budget, and those the screen
puts over it (``meshdsl/search/floor.py``: arguments and outputs plus the unsharded program's
temporaries as the layout could split them, an estimate that errs low).

Run: ``python -m bench.search_speed`` (writes bench/results/search_speed.{json,md}).
"""

from __future__ import annotations

import time

from bench import common  # noqa: F401 - sets up devices first

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

import meshdsl as md  # noqa: E402
from meshdsl.models.configs import get_config  # noqa: E402
from meshdsl.models.llama import Llama  # noqa: E402
from meshdsl.models.loss import lm_loss  # noqa: E402
from bench.common import write  # noqa: E402
from bench.search_configs import _step  # noqa: E402

DIMS = {"batch, heads, d_ff": (["batch", "heads", "d_ff"], 1000),
        "batch, heads, d_ff, vocab, d_model": (["batch", "heads", "d_ff", "vocab", "d_model"], 1000),
        "every dim (top 10)": (None, 10)}


def _llama():
    """llama-3-8b's training step at 16 x 32768 tokens (remat full), abstract."""
    model = nnx.eval_shape(lambda: Llama(get_config("llama-3-8b"), rngs=nnx.Rngs(0)))
    tokens = md.named(jax.ShapeDtypeStruct((16, 32768), jnp.int32), "batch targets")
    batch = {"decoder_input_tokens": tokens, "decoder_target_tokens": tokens,
             "decoder_loss_weights": md.named(jax.ShapeDtypeStruct((16, 32768), jnp.float32), "batch targets")}

    def step(model, batch):
        return nnx.value_and_grad(lambda m: lm_loss(m, batch, train=True, remat="full")[0].array)(model)
    return step, model, batch


def _row(program, name, result, seconds) -> dict:
    early = sum(c.why.startswith(("pruned", "over the memory budget before costing")) for c in result.rejected)
    screened = sum("(screen)" in c.why for c in result.rejected)
    return {"program": program, "dims": name, "enumerated": len(result) + len(result.rejected),
            "before_tracing": early, "screened": screened, "bounded": result.bounded,
            "costed": result.costed, "retimed": result.retimed, "ranked": len(result), "seconds": seconds,
            "per_costed_s": seconds / max(result.costed, 1), "best": f"{result.best.mesh} {result.best.layout}"}


def run(quick: bool = False) -> str:
    step, model, data = _step(1024)
    rows = []
    for name, (dims, top) in DIMS.items():
        if quick and (dims is None or len(dims) > 3):
            continue
        t = time.perf_counter()
        result = md.search(step, 512, model, data, hardware="h100-80gb", top=top, dims=dims)
        rows.append(_row("t5-v1_1-xxl, 512 devices", name, result, time.perf_counter() - t))
    if not quick:
        step, model, data = _llama()
        t = time.perf_counter()
        result = md.search(step, 64, model, data, hardware="h100-80gb", memory_budget=80e9)
        rows.append(_row("llama-3-8b 16 x 32768, 64 devices", "every dim (top 10)", result, time.perf_counter() - t))
    return write("search_speed", rows, [
        ("program", lambda r: r.get("program", "t5-v1_1-xxl, 512 devices")),
        ("dims searched", lambda r: r["dims"]), ("layouts", lambda r: r["enumerated"]),
        ("rejected before tracing", lambda r: r["before_tracing"]), ("of them by the screen", lambda r: r["screened"]),
        ("not costed (compute floor over the top's)", lambda r: r.get("bounded", 0)),
        ("traced", lambda r: r["costed"]),
        ("retimed", lambda r: r["retimed"]), ("fit the budget", lambda r: r["ranked"]),
        ("seconds", lambda r: f"{r['seconds']:.0f}"), ("s per traced", lambda r: f"{r['per_costed_s']:.2f}"),
        ("best", lambda r: f"`{r['best']}`")],
        "Search time: t5-v1_1-xxl on 512 devices, llama-3-8b on 64 (counts)",
        "t5-v1_1-xxl train step (remat full), batch 1024 x 512/128; llama-3-8b train step (remat full), batch 16 x "
        "32768; every factorisation of the count into data or data x model, h100-80gb profile, 80 GB budget; the "
        "layouts left after equivalent ones are merged.")


if __name__ == "__main__":
    print(run())
