"""bench/gpu.py (the GPU benchmark) in its --quick mode on CPU: it runs, writes its JSON and markdown
where --out says, and refuses a full run without a GPU (exit 2)."""

import json

from bench import gpu


def test_quick_run_writes_rows_and_tables(tmp_path, capsys):
    assert gpu.main(["--quick", "--pairs", "1", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert data["machine"]["jax"] and data["machine"]["device_kind"] and data["machine"]["date"]
    assert data["quick"] is True and data["matmul_peak_flops"] > 0
    (row,) = data["rows"]
    for key in ("explicit_s", "gspmd_s", "ratio", "tokens_per_s", "tflops", "mfu_peak", "mfu_matmul",
                "compiled_memory", "explain_memory", "memory_ratio", "predicted_s", "predicted_ratio"):
        assert row[key] is not None, key
    assert row["explicit_s"] > 0 and row["gspmd_s"] > 0
    assert row["compiled_memory"]["peak"] > 0 and row["explain_memory"]["peak"] > 0
    (att,) = data["attention"]
    assert att["flash_s"] > 0 and att["ratio"] is None and "unavailable" in att["cudnn_note"]   # a CPU: no cuDNN
    md_text = (tmp_path / "gpu.md").read_text()
    assert md_text.startswith("### GPU")
    assert "| batch x seq | explicit ms | gspmd ms |" in md_text and "cuDNN / blockwise" in md_text
    assert "explain / compiled" in md_text and "predicted / measured" in md_text


def test_full_run_needs_a_gpu(tmp_path, capsys):
    assert gpu.main(["--out", str(tmp_path)]) == 2
    assert "no GPU" in capsys.readouterr().err
    assert not (tmp_path / "gpu.json").exists()
