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
