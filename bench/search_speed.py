"""How long ``md.search`` takes: t5-v1_1-xxl on 512 devices given as a count.

The training step of ``bench.search_configs`` (remat full, float32 weights) with a batch of 1024
sequences of 512 / 128 tokens, searched over every factorisation of 512 into ``data`` or
``data x model`` on the ``h100-80gb`` profile, for two sets of dims: the three a T5 user splits
first (batch, heads, d_ff) and five (adding vocab and d_model). Reported per search: the layouts
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

import meshdsl as md  # noqa: E402
from bench.common import write  # noqa: E402
from bench.search_configs import _step  # noqa: E402

DIMS = {"batch, heads, d_ff": ["batch", "heads", "d_ff"],
        "batch, heads, d_ff, vocab, d_model": ["batch", "heads", "d_ff", "vocab", "d_model"]}


def run(quick: bool = False) -> str:
    step, model, data = _step(1024)
    rows = []
    for name, dims in DIMS.items():
        if quick and len(dims) > 3:
            continue
        t = time.perf_counter()
        result = md.search(step, 512, model, data, hardware="h100-80gb", top=1000, dims=dims)
        seconds = time.perf_counter() - t
        early = sum(c.why.startswith(("pruned", "over the memory budget before costing")) for c in result.rejected)
        screened = sum("(screen)" in c.why for c in result.rejected)
        rows.append({"dims": name, "enumerated": len(result) + len(result.rejected), "before_tracing": early,
                     "screened": screened,
                     "costed": result.costed, "retimed": result.retimed, "ranked": len(result), "seconds": seconds,
                     "per_costed_s": seconds / max(result.costed, 1), "best": f"{result.best.mesh} {result.best.layout}"})
    return write("search_speed", rows, [
        ("dims searched", lambda r: r["dims"]), ("layouts", lambda r: r["enumerated"]),
        ("rejected before tracing", lambda r: r["before_tracing"]), ("of them by the screen", lambda r: r["screened"]),
        ("traced", lambda r: r["costed"]),
        ("retimed", lambda r: r["retimed"]), ("fit the budget", lambda r: r["ranked"]),
        ("seconds", lambda r: f"{r['seconds']:.0f}"), ("s per traced", lambda r: f"{r['per_costed_s']:.2f}"),
        ("best", lambda r: f"`{r['best']}`")],
        "Search time: t5-v1_1-xxl on 512 devices (a count)",
        "t5-v1_1-xxl train step (remat full), batch 1024 x 512/128, every factorisation of 512 into data or "
        "data x model, h100-80gb profile, 80 GB budget; the layouts left after equivalent ones are merged.")


if __name__ == "__main__":
    print(run())
