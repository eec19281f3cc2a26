"""Run every benchmark and write bench/results/*.json and *.md, then README's results section.

    python bench/run.py [--quick]

``--quick`` uses short sequences and fewer layouts for step time (under 10 minutes on 2 cores), and
fewer microbatch counts for the pipeline.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench import common  # noqa: E402,F401 - sets up devices first
from bench import communication, compile_time, fused_step, memory, moe, offload, pipeline, readme  # noqa: E402
from bench import schedules, search_configs, search_rank, search_speed, step_time  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="short sequences, fewer step-time layouts")
    p.add_argument("--no-readme", action="store_true", help="do not rewrite README's results section")
    a = p.parse_args(argv)
    start = time.perf_counter()
    for name, bench in (("communication", communication), ("compile time", compile_time), ("memory", memory),
                        ("pipeline", pipeline), ("schedules", schedules), ("fused step", fused_step),
                        ("step time", step_time), ("search rank", search_rank), ("search configs", search_configs),
                        ("search speed", search_speed), ("offload", offload), ("moe", moe)):
        t = time.perf_counter()
        print(f"== {name}", flush=True)
        print(bench.run(a.quick), flush=True)
        print(f"({name}: {time.perf_counter() - t:.0f} s)", flush=True)
    if not a.no_readme:
        readme.update()
    print(f"all benchmarks: {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
