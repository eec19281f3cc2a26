"""The README's example runs as written and prints what the README says."""

import pathlib
import re


def test_readme_example_runs(capsys):
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = re.search(r"## A 20-line example: Megatron MLP\n\n```python\n(.*?)```", text, re.S).group(1)
    assert len(code.strip().splitlines()) <= 20
    exec(compile(code, "mlp.py", "exec"), {})
    printed = capsys.readouterr().out
    assert "| all-reduce | 1 | 12.00 KiB |" in printed
    assert "from einsum at mlp.py:11 pending sum" in printed
    for line in printed.strip().splitlines():  # the README shows this run's explain output
        assert line in text, line


def test_the_pipeline_row_of_the_cheat_sheet_is_truthful():
    """GPipe and 1F1B: yes (md.lower takes them, the CLI's --schedule too); circular: not yet (both
    refuse it)."""
    import pytest

    import meshdsl as md
    from meshdsl.models import faults

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| Pipeline (GPipe, 1F1B) |")]
    assert "--schedule gpipe" in row and "--schedule 1f1b" in row and "circular schedule: not yet" in row
    assert "MoE-T5 stacks" in row and "scan outputs with the `batch` dim" in row
    assert 'schedule="1f1b"' in row and "head=loss" in row
    for name in ("gpipe", "1f1b"):
        md.lower(lambda x: x, md.Mesh({"pipe": 8}), md.Layout({"layers": "pipe"}), schedule=name)
    faults.check_schedule("gpipe")
    faults.check_schedule("1f1b")
    with pytest.raises(md.MeshDSLError, match="not lowered yet"):
        md.lower(lambda x: x, md.Mesh({"pipe": 8}), md.Layout({"layers": "pipe"}), schedule="circular")
    with pytest.raises(SystemExit, match="is not implemented yet"):
        faults.check_schedule("circular")
