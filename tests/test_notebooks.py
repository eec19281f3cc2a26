"""The notebooks run headless, top to bottom, without an error, and draw their plots.

Each notebook is stored without outputs and executed with nbclient on a ``python3`` kernel that
must be this interpreter (the venv's): a first cell, added in memory only, checks it. The kernel
sets up its own 8 virtual CPU devices in the notebook's first code cell.

Nothing here depends on wall time: a loaded machine runs the cells slower, not wrongly. The cell
timeout is only a guard against a hung kernel, far above any real run; the time each notebook
took is printed, not asserted.
"""

import json
import pathlib
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
HANG_GUARD_S = 1800  # per cell: a hung kernel fails the test instead of blocking the suite


def test_the_notebooks_exist():
    assert [p.name for p in NOTEBOOKS] == ["01_named_dims_and_layouts.ipynb", "02_t5_layouts.ipynb",
                                           "03_moe_expert_parallel.ipynb", "04_decode_layouts.ipynb",
                                           "05_pipelines.ipynb", "06_layout_search.ipynb"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_clean_and_sets_devices_first(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code), "store notebooks with outputs stripped"
    first = code[0].source
    assert "--xla_force_host_platform_device_count=8" in first
    assert first.index("XLA_FLAGS") < first.index("import jax")
    assert nb.metadata.kernelspec.name == "python3"


# 02 (T5 under six layouts, ~2 min), 03 (MoE under expert parallelism, ~20 s; tests/test_moe*.py),
# 04 (decoding under each layout, ~20 s; tests/test_generate.py decodes under every layout), 05 (pipelines, ~20 s; tests/test_pipeline*.py) and 06 (the layout
# search, ~70 s; md.search's behaviour is tests/test_search.py's) run with the end-to-end tests:
# python -m pytest -m slow
SLOW = ("02_t5_layouts", "03_moe_expert_parallel", "04_decode_layouts", "05_pipelines", "06_layout_search")
RUNS = [pytest.param(p, marks=pytest.mark.slow) if p.stem in SLOW else p for p in NOTEBOOKS]


@pytest.mark.parametrize("path", RUNS, ids=lambda p: p.stem)
def test_notebook_runs(path, capsys):
    nb = nbformat.read(path, as_version=4)
    probe = nbformat.v4.new_code_cell("import sys, jax; print(sys.executable)")
    nb.cells.insert(0, probe)
    client = nbclient.NotebookClient(nb, timeout=HANG_GUARD_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    client.execute()  # raises CellExecutionError on the first failing cell
    seconds = time.perf_counter() - start
    with capsys.disabled():
        print(f"\n{path.name}: {seconds:.1f} s")
    assert probe.outputs[0]["text"].strip() == sys.executable, "the python3 kernel is not this interpreter"
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
    assert not errors, json.dumps(errors)[:2000]
    images = sum("image/png" in o.get("data", {}) for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert images >= 3, "the notebook's plots did not render"
