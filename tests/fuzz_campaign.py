"""The long fuzz campaign of issue 9: random programs for a wall-clock budget, every case checked,
every failure kept (not only the first, as a hypothesis test would) and counted by kind.

    python tests/fuzz_campaign.py --minutes 60 --seed 1 --out runs/fuzz-campaign
    python tests/fuzz_campaign.py --minutes 10 --ops attention,einsum,rename --out runs/fuzz-attention

Each case is one random program (``fuzz_draw.programs`` over all ops, 1-D, 2-D and 3-D meshes,
``params=`` rules, the three ``param_gather`` modes) and one of two checks, drawn in turn:

* ``values``: an invalid layout must raise ``md.MeshDSLError``; a valid one must give the
  unsharded forward values, the gradients of ``jax.grad`` inside the lowered function and of
  ``jax.grad`` around it;
* ``bytes``: explicit bytes <= gspmd bytes and ``md.explain`` == ``hlo_comm`` per collective kind,
  for the program and its gradient, with float32 or bfloat16 float inputs. Under ``param_gather="keep"`` / ``"regather"`` a stored
  parameter is gathered where an op reads it, by contract, where gspmd may move activations
  instead: such a program passes (``bytes-ok-gathered-by-policy``, counted apart) only if
  ``"auto"`` on it moves no more than gspmd.

Writes ``cases.jsonl`` (one line per case: check, outcome, seconds), ``failures.jsonl`` (the kind,
the message and the program) and ``summary.json`` (counts by outcome, the worst explicit/gspmd
ratio of the programs the promise covers, and apart the worst of those exempt by contract:
``md.local_map`` gathering what it does not keep, ``keep``/``regather`` gathering a stored
weight). Not a test: the suite runs the small profile in ``test_fuzz.py``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import sys
import time
import traceback

# as tests/conftest.py: 8 virtual devices, LLVM at -O0 (faster compiles; the same HLO and collectives)
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
                           " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(pathlib.Path(__file__).parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from hypothesis import HealthCheck, Phase, given, seed, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import meshdsl as md  # noqa: E402

from fuzz_draw import programs  # noqa: E402
from fuzz_programs import ALL_OPS  # noqa: E402
from test_fuzz import _bytes, _finite, _gathers_by_policy, _grads_inside, _lower, _same_as_unsharded  # noqa: E402


# Mixed precision: bytes cases draw bfloat16 float inputs too (exact figures: the bytes promise and
# explain == HLO hold alike; on CPU a bf16 all-reduce moves as f32). Values cases stay float32: the
# reference runs in another summation order, and bf16 rounding would need a tolerance that hides bugs.
DTYPES = {"values": ("float32",), "bytes": ("float32", "bfloat16")}


class Failure(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _stage(kind, thunk):
    """Run one stage; an assertion is a finding of ``kind``, any other non-meshdsl error escaping a
    valid program is a raw error."""
    try:
        return thunk()
    except AssertionError as e:
        raise Failure(kind, str(e)[:2000]) from None
    except md.MeshDSLError as e:
        raise Failure(f"meshdsl-error:{type(e).__name__}", str(e)[:2000]) from None
    except Exception as e:  # noqa: BLE001 - the point is to catch what escapes
        raise Failure(f"raw-error:{type(e).__name__}", traceback.format_exc()[-2000:]) from None


def check_values(prog, stats):
    args = prog.args()
    if not prog.layout_valid():
        try:
            _lower(prog)(*args)
        except md.MeshDSLError:
            return "invalid-refused"
        except Exception:  # noqa: BLE001
            raise Failure("invalid-raw-error", traceback.format_exc()[-2000:]) from None
        raise Failure("invalid-accepted", "an invalid layout ran")
    ref = prog.fn(*args)
    if not _finite(ref):
        return "skipped-nonfinite"
    _stage("forward", lambda: _same_as_unsharded(_lower(prog)(*args), prog.fn, args, ref))
    if not prog.float_inputs():
        return "forward-ok"
    g_ref = _grads_inside(prog)(*args)
    if not _finite(g_ref):
        return "forward-ok"
    _stage("grad-inside", lambda: _same_as_unsharded(_lower(prog, _grads_inside(prog))(*args), _grads_inside(prog), args,
                                                     g_ref))
    f, idx = _lower(prog), tuple(prog.float_inputs())

    def around(*a):
        return sum(jnp.sum(jnp.tanh(y.array)) * (0.5 + 0.25 * k) for k, y in enumerate(f(*a)))

    _stage("grad-around", lambda: _same_as_unsharded(jax.grad(around, argnums=idx)(*args), _grads_inside(prog), args,
                                                     g_ref))
    return "values-and-grads-ok"


def check_bytes(prog, stats):
    args = prog.args()
    fns = [("forward", prog.fn)] + ([("grad", _grads_inside(prog))] if prog.float_inputs() else [])
    policy = False
    for label, fn in fns:
        ours, theirs, predicted, measured = _stage("raw", lambda: _bytes(prog, fn, args))
        ratio = ours / theirs if theirs else (1.0 if not ours else float("inf"))
        if predicted != measured:
            raise Failure(f"explain-mismatch-{label}", f"explain {predicted} hlo {measured}")
        exempt = ours > theirs and prog.opaque_gathers()   # local_map gathers what it does not keep
        if ours > theirs and not exempt:
            if not _stage("raw", lambda: _gathers_by_policy(prog, fn, args, theirs)):
                raise Failure(f"bytes-worse-{label}", f"explicit {ours} > gspmd {theirs}")
            policy = exempt = True
        # the worst ratio of the programs the promise covers; those exempt by contract apart
        key = "worst_exempt" if exempt else "worst"
        stats["ratios"].append(ratio)
        if theirs and ratio > stats[key][0]:
            stats[key] = (ratio, ours, theirs, prog.describe())
    return "bytes-ok-gathered-by-policy" if policy else "bytes-ok"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=20, help="cases per hypothesis run (one seed each)")
    ap.add_argument("--out", default="runs/fuzz-campaign")
    ap.add_argument("--ops", default=None,
                    help="comma-separated op families to draw from (default: all), e.g. attention,rename,einsum")
    a = ap.parse_args(argv)
    ops = ALL_OPS if a.ops is None else a.ops.split(",")
    unknown = sorted(set(ops) - set(ALL_OPS))
    if unknown:
        ap.error(f"unknown op families {unknown}; choose from {sorted(set(ALL_OPS))}")
    out = pathlib.Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    cases, failures = (out / "cases.jsonl").open("a"), (out / "failures.jsonl").open("a")
    stats = {"ratios": [], "worst": (0.0, 0, 0, ""), "worst_exempt": (0.0, 0, 0, "")}
    counts = collections.Counter()
    deadline = time.time() + 60 * a.minutes
    start = time.time()

    def record(check, prog):
        t0 = time.time()
        try:
            outcome = (check_values if check == "values" else check_bytes)(prog, stats)
        except Failure as f:
            outcome = f"FAIL {f.kind}"
            failures.write(json.dumps({"check": check, "kind": f.kind, "message": str(f),
                                       "program": prog.describe()}) + "\n")
            failures.flush()
        counts[(check, outcome)] += 1
        cases.write(json.dumps({"check": check, "outcome": outcome, "seconds": round(time.time() - t0, 2)}) + "\n")
        cases.flush()

    run = 0
    while time.time() < deadline:
        @seed(a.seed * 100003 + run)
        @settings(max_examples=a.batch, database=None, deadline=None, derandomize=False,
                  suppress_health_check=list(HealthCheck), phases=[Phase.generate])
        @given(data=st.data())
        def batch(data):
            check = data.draw(st.sampled_from(["values", "bytes"]))
            prog = data.draw(programs(ops=ops, allow_invalid=check == "values", dtypes=DTYPES[check]))
            if time.time() >= deadline:
                return   # after drawing: hypothesis wants every example drawn the same way
            jax.clear_caches() if sum(counts.values()) % 200 == 199 else None
            record(check, prog)

        batch()
        run += 1
        summary = {"minutes": round((time.time() - start) / 60, 1), "cases": sum(counts.values()),
                   "counts": {f"{c}: {o}": n for (c, o), n in sorted(counts.items())},
                   "worst_ratio": stats["worst"][0], "worst_bytes": stats["worst"][1:3],
                   "worst_program": stats["worst"][3],
                   "worst_exempt_ratio": stats["worst_exempt"][0], "worst_exempt_bytes": stats["worst_exempt"][1:3],
                   "worst_exempt_program": stats["worst_exempt"][3],
                   "ratios_over_1": sum(r > 1 for r in stats["ratios"]), "ratios": len(stats["ratios"]),
                   "commit": os.popen("git rev-parse --short HEAD").read().strip()}
        (out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(f"[{summary['minutes']} min] {summary['cases']} cases, "
              f"{sum(n for (c, o), n in counts.items() if o.startswith('FAIL'))} failures", flush=True)
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
