"""Replay fuzz findings: rebuild a :class:`fuzz_programs.Program` from the text ``Program.describe``
prints (what a failing hypothesis case and ``fuzz_campaign.py``'s ``failures.jsonl`` record), and
check it again with the current code.

    python tests/fuzz_replay.py runs/fuzz-campaign/failures.jsonl

Input values are drawn afresh (seeded): the checks compare sharded with unsharded runs of the
same values, so a finding about bytes, explain or a raw error replays exactly; one about values
replays with other numbers.
"""

from __future__ import annotations

import ast
import json
import re
import sys

from fuzz_campaign import Failure, check_bytes, check_values  # first: sets the 8 CPU devices
import numpy as np  # noqa: E402

from fuzz_programs import Program, Value, size_of  # noqa: E402

_HEAD = re.compile(r"mesh=(\{.*?\}) layout=(\{.*?\}) params=(\{.*?\}) param_gather=(\w+)(?: dtype=(\w+))?$")
_INPUT = re.compile(r"\s*v(\d+) = input \[(.*?)\] (\w+)( param)?$")
_STEP = re.compile(r"\s*v(\d+) = (\w+)\((.*?); (\{.*\})\) -> \[(.*?)\]$")


def parse(text: str, seed: int = 0) -> Program:
    lines = text.strip().splitlines()
    mesh, layout, params, gather, dtype = _HEAD.match(lines[0]).groups()
    rng = np.random.default_rng(seed)
    inputs, values, steps, outputs = [], [], [], []
    for line in lines[1:]:
        if m := _INPUT.match(line):
            names, kind, is_param = tuple(m.group(2).split()), m.group(3), bool(m.group(4))
            shape = tuple(size_of(n) for n in names)
            arr = (rng.standard_normal(shape).astype(np.float32) if kind == "float"
                   else rng.integers(-3, 19, shape).astype(np.int32))
            inputs.append((names, kind, is_param, arr))
            values.append(Value(names, kind, is_param))
        elif m := _STEP.match(line):
            op, operands = m.group(2), [int(v[1:]) for v in m.group(3).split(", ") if v]
            steps.append((op, ast.literal_eval(m.group(4)), operands))
            keeps = op in ("rename", "reshape") and values[operands[0]].is_param
            values.append(Value(tuple(m.group(5).split()), "float", keeps))
        elif line.strip().startswith("return"):
            outputs = [int(v.strip()[1:]) for v in line.strip()[len("return "):].split(",")]
    return Program(ast.literal_eval(mesh), ast.literal_eval(layout), ast.literal_eval(params), gather,
                   inputs, steps, outputs, values, dtype or "float32")


def main(path):
    stats = {"ratios": [], "worst": (0.0, 0, 0, ""), "worst_exempt": (0.0, 0, 0, "")}
    for k, line in enumerate(open(path)):
        rec = json.loads(line)
        prog = parse(rec["program"])
        try:
            outcome = (check_values if rec["check"] == "values" else check_bytes)(prog, stats)
        except Failure as f:
            outcome = f"FAIL {f.kind}: {str(f)[:160]}"
        print(f"{k}: was {rec['kind']} -> {outcome}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
