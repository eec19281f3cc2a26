"""bench/moe.py (dropless vs capacity MoE under expert parallelism) on one shape, one capacity
factor and one timed pair: it runs, writes its JSON and markdown where ``out`` says, the dropless
layer drops nothing (at a stated exchange bound it moves fewer bytes and counts what it drops), and
explain predicts the compiled bytes of every layer."""

import json

import pytest

from bench import moe


@pytest.mark.slow  # ~30 s on 2 cores; the layers' bytes, drops and bounds are tests/test_dropless_experts.py's
def test_one_shape_writes_rows_and_tables(tmp_path):
    moe.run(pairs=1, out=str(tmp_path), shapes=moe.SHAPES[:1], factors=(1.0,))
    data = json.loads((tmp_path / "moe.json").read_text())
    assert data["machine"]["jax"] and data["machine"]["date"] and "XLA:CPU" in data["cpu_note"]
    capacity, dropless, bounded = data["rows"]
    assert (capacity["layer"], dropless["layer"], bounded["layer"]) == ("capacity", "dropless", "dropless")
    assert dropless["dropped_fraction"] == 0.0 and 0.0 < capacity["dropped_fraction"] < 0.5
    assert bounded["capacity_factor"] == moe.BOUND and 0.0 <= bounded["dropped_fraction"] < 0.5
    assert bounded["hlo_bytes"] < dropless["hlo_bytes"]   # the stated bound's buffer: fewer rows than any routing's
    for r in (capacity, dropless, bounded):
        assert r["explain_bytes"] == r["hlo_bytes"] >= r["minimum_bytes"] > 0
        assert r["explicit_s"] > 0 and r["compiled_temporaries"] > 0 and r["explain_flops"] > 0
    assert capacity["hlo_bytes"] <= 1.05 * capacity["minimum_bytes"]     # capacity 1.0: the exchange, about
    assert capacity["gspmd_s"] > 0 and capacity["hlo_bytes"] <= capacity["gspmd_bytes"]
    text = (tmp_path / "moe.md").read_text()
    assert text.startswith("### MoE") and "| explain = HLO |" in text and "Memory and local compute" in text
