"""The documentation is tested: its examples run, its site builds, and the package is what it says.

* Every ``>>>`` example in the docstrings of the modules with doctests and in the pages of ``docs/``
  runs here (8 virtual CPU devices, see conftest) and must print what it shows.
* ``mkdocs build --strict`` builds the site, API reference included (mkdocstrings reads the
  docstrings), with every warning an error: a broken link, a page missing from the nav, a
  reference to a name that no longer exists.
* ``import meshdsl`` needs only the base dependencies (jax, numpy); the version has one source.
"""

import doctest
import html
import importlib
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

import meshdsl
import meshdsl._version

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

MODULES_WITH_EXAMPLES = ["meshdsl.names.dims", "meshdsl.names.mesh", "meshdsl.names.layout", "meshdsl.names.errors", "meshdsl.costmodel.cost",
                         "meshdsl.costmodel.hardware", "meshdsl.costmodel.step_time", "meshdsl.costmodel.constants",
                         "meshdsl.costmodel.schedule"]
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
PAGES_WITHOUT_EXAMPLES = {"api.md", "architecture.md"}  # generated from docstrings / a module map


@pytest.mark.parametrize("name", MODULES_WITH_EXAMPLES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=FLAGS, verbose=False)
    assert result.attempted > 0, f"{name} has no docstring examples"
    assert result.failed == 0, f"{result.failed} docstring examples of {name} failed (see the output above)"


@pytest.mark.parametrize("page", PAGES)
def test_page_examples(page):
    result = doctest.testfile(str(DOCS / page), module_relative=False, optionflags=FLAGS, verbose=False,
                              encoding="utf-8")
    assert result.failed == 0, f"{result.failed} examples of docs/{page} failed (see the output above)"
    if page not in PAGES_WITHOUT_EXAMPLES:
        assert result.attempted > 0, f"docs/{page} has no runnable example"


def test_site_builds_strict_with_the_api_reference(tmp_path):
    site = tmp_path / "site"
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                          "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    # (not --quiet: it hides the warnings from --strict, and the build would pass with them)
    assert run.returncode == 0, run.stdout + run.stderr
    for page in PAGES:
        built = site / ("index.html" if page == "index.md" else page.removesuffix(".md") + "/index.html")
        assert built.exists(), f"docs/{page} was not built"
    api = (site / "api" / "index.html").read_text()
    for name in ("meshdsl.Dim", "meshdsl.Mesh", "meshdsl.Layout", "meshdsl.named", "meshdsl.einsum",
                 "meshdsl.lowering.lower.lower", "meshdsl.views.explain.explain", "meshdsl.LayoutError"):
        assert f'id="{name}"' in api, f"{name} is missing from the API reference"
    # signatures are the public functions' (the rules' ``ctx`` argument is not shown)
    text = html.unescape(re.sub(r"<[^>]+>", "", api))
    assert "einsum(*operands, out" in text and "einsum(ctx" not in text
    assert "A named dimension: name (an identifier) and a global size" in text  # docstrings rendered


def test_import_meshdsl_needs_only_the_base_dependencies():
    optional = ["flax", "optax", "orbax", "sentencepiece", "rich", "matplotlib", "treescope", "torch",
                "transformers", "einops", "IPython", "mkdocs"]
    code = ("import sys, meshdsl as md; md.Mesh.abstract({'data': 8}); "
            f"print(sorted(m for m in {optional!r} if m in sys.modules))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", f"import meshdsl imported optional dependencies: {run.stdout}"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = sorted(dep.split(">")[0].split("<")[0].split("=")[0].strip() for dep in project["dependencies"])
    assert base == ["jax", "numpy"]


def test_version_has_one_source_and_the_package_is_typed():
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "version" in pyproject["project"]["dynamic"] and "version" not in pyproject["project"]
    assert pyproject["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "meshdsl._version.__version__"}
    assert meshdsl.__version__ == meshdsl._version.__version__
    assert pyproject["tool"]["setuptools"]["package-data"]["meshdsl"] == ["py.typed"]
    assert (ROOT / "meshdsl" / "py.typed").exists()
    assert pyproject["project"]["license"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text()
