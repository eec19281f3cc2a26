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
    """GPipe, 1F1B and circular: md.lower takes them, the CLI's --schedule too; interleaved and
    zero-bubble schedules are not there (both refuse them)."""
    import pytest

    import meshdsl as md
    from meshdsl.models.training import faults

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith("| Pipeline (GPipe, 1F1B, circular) |")]
    assert "--schedule gpipe" in row and "--schedule 1f1b" in row
    assert 'schedule="circular"' in row and "repeats=R" in row and "M >= S" in row
    assert "MoE-T5 stacks" in row and "scan outputs with the `batch` dim" in row
    assert 'schedule="1f1b"' in row and "head=loss" in row
    for name in ("gpipe", "1f1b", "circular"):
        md.lower(lambda x: x, md.Mesh({"pipe": 8}), md.Layout({"layers": "pipe"}), schedule=name)
        faults.check_schedule(name)
    with pytest.raises(md.MeshDSLError, match="schedule must be one of"):
        md.lower(lambda x: x, md.Mesh({"pipe": 8}), md.Layout({"layers": "pipe"}), schedule="interleaved")