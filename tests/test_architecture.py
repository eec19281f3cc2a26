"""The core's structure, as tested interface: imports only go downward (no cycles), no import
hides inside a function body, modules and functions stay small, and the facade exports the
contract. Reads the source with ``ast``: nothing is imported or compiled."""

import ast
import pathlib
import re

import pytest

import meshdsl as md

ROOT = pathlib.Path(md.__file__).parent
OPTIONAL = {"matplotlib", "treescope"}           # heavy optional dependencies, imported on first use
LAZY_IMPORTS = {("hlo_comm.py", "_demo")}  # the HLO measuring tool works without jax: only its --demo imports it


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


MODULES = _modules()


def _resolve(node: ast.ImportFrom | ast.Import, package: str, modules) -> set[str]:
    """The modules of ``modules`` one import statement of a module of ``package`` names."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        base = package.split(".")[: len(package.split(".")) - node.level + 1]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module or ""
    return {f"{target}.{a.name}" if f"{target}.{a.name}" in modules else target for a in node.names}


def _imports(name: str, tree: ast.Module) -> set[str]:
    """meshdsl modules that module ``name`` imports at its top level."""
    is_pkg = MODULES[name].name == "__init__.py"
    package = name if is_pkg else name.rpartition(".")[0]
    deps = set()
    for node in tree.body:
        if isinstance(node, (ast.ImportFrom, ast.Import)):
            deps |= _resolve(node, package, MODULES)
    return {d for d in deps if d in MODULES and d != name}


def _graph() -> dict[str, set[str]]:
    return {name: _imports(name, ast.parse(path.read_text())) for name, path in MODULES.items()}


def _cycle(graph):
    state, stack = {}, []

    def visit(u):
        state[u] = "open"
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == "open":
                return stack[stack.index(v):] + [v]
            if v not in state:
                found = visit(v)
                if found:
                    return found
        stack.pop()
        state[u] = "done"
        return None

    for u in sorted(graph):
        if u not in state:
            found = visit(u)
            if found:
                return found
    return None


def test_the_import_graph_of_meshdsl_has_no_cycle():
    graph = _graph()
    assert len(graph) > 20
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


MODELS_ROOT = ROOT.parent / "models"                  # installed as meshdsl.models (pyproject's package-dir)
MODEL_FLOORS = ["data", "families", "hub", "decoding", "training", "cli"]
# the public paths users, docs, notebooks and outside scripts import: thin facades over the floors
MODEL_FACADES = {"configs", "llama_configs", "llama", "t5", "loss", "inference", "generation", "hf", "autolayout",
                 "train", "generate", "export"}


def _model_modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in MODELS_ROOT.rglob("*.py"):
        parts = ("meshdsl", "models", *path.relative_to(MODELS_ROOT).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODEL_MODULES = _model_modules()


def _models_graph() -> dict[str, set[str]]:
    """The model package's modules and the modules of it each imports anywhere (a function body's
    import included: a cycle hidden in one still ties the two modules together)."""
    graph = {}
    for name, path in MODEL_MODULES.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.ImportFrom, ast.Import)):
                deps |= _resolve(node, package, MODEL_MODULES)
        graph[name] = {d for d in deps if d in MODEL_MODULES and d != name}
    return graph


def _model_floor(module: str) -> int:
    """The floor of a meshdsl.models module (its subpackage's place in ``MODEL_FLOORS``); the
    package and its facades are above all."""
    parts = module.split(".")
    return MODEL_FLOORS.index(parts[2]) if len(parts) > 2 and parts[2] in MODEL_FLOORS else len(MODEL_FLOORS)


def test_the_model_package_has_no_import_cycle():
    graph = _models_graph()
    assert len(graph) > 20 and "meshdsl.models.decoding.generation_lm" in graph["meshdsl.models.decoding.generation"]
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_every_model_module_lives_in_a_subpackage_and_the_public_paths_are_facades():
    top = {n.rpartition(".")[2] for n in MODEL_MODULES if _model_floor(n) == len(MODEL_FLOORS) and n != "meshdsl.models"}
    assert top == MODEL_FACADES, sorted(top ^ MODEL_FACADES)


@pytest.mark.parametrize("name", sorted(MODEL_FACADES))
def test_a_model_facade_only_re_exports_a_subpackage_s_names(name):
    """A docstring, imports from the floors, ``__all__`` (every name imported), and a command's
    ``if __name__ == "__main__"``: no logic."""
    tree = ast.parse((MODELS_ROOT / f"{name}.py").read_text())
    assert ast.get_docstring(tree), name
    imported, exported = set(), None
    for node in tree.body[1:]:
        if isinstance(node, ast.ImportFrom):
            assert _model_floor(node.module) < len(MODEL_FLOORS), ast.unparse(node)
            imported.update(a.asname or a.name for a in node.names)
        elif isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["__all__"]:
            exported = ast.literal_eval(node.value)
        elif isinstance(node, ast.If) and ast.unparse(node.test) == "__name__ == '__main__'":
            assert name in ("train", "generate", "export"), name
        else:
            assert isinstance(node, ast.Import) and [a.name for a in node.names] == ["sys"], ast.unparse(node)
    assert exported and set(exported) == imported, (name, exported, imported)


def test_model_subpackages_import_only_their_own_floor_and_the_floors_below():
    """Function bodies' imports included; a facade is above every floor, so no floor imports one."""
    graph = _models_graph()
    upward = sorted(f"{u} -> {v}" for u, deps in graph.items() for v in deps if _model_floor(v) > _model_floor(u))
    assert not upward, upward


@pytest.mark.parametrize("floor", MODEL_FLOORS)
def test_each_model_subpackage_says_what_it_owns_and_what_it_may_import(floor):
    doc = ast.get_docstring(ast.parse((MODELS_ROOT / floor / "__init__.py").read_text())) or ""
    assert len(doc) > 80 and "May import" in doc, floor


FLOORS = ["platform", "names", "costmodel", "rewrite", "ops", "planner", "lowering", "views", "search"]


def _floor(module: str) -> int:
    """The floor of a meshdsl module (its subpackage's place in ``FLOORS``); the facade is above all."""
    parts = module.split(".")
    return FLOORS.index(parts[1]) if len(parts) > 1 and parts[1] in FLOORS else len(FLOORS)


def test_every_module_lives_in_a_subpackage_of_one_concept():
    loose = sorted(n for n in MODULES if _floor(n) == len(FLOORS) and n not in ("meshdsl", "meshdsl.random",
                                                                                "meshdsl._version"))
    assert not loose, loose


def test_subpackages_import_only_their_own_floor_and_the_floors_below():
    graph = _graph()
    upward = sorted(f"{u} -> {v}" for u, deps in graph.items() for v in deps if _floor(v) > _floor(u))
    assert not upward, upward


@pytest.mark.parametrize("floor", FLOORS)
def test_each_subpackage_says_what_it_owns_and_what_it_may_import(floor):
    doc = ast.get_docstring(ast.parse((ROOT / floor / "__init__.py").read_text())) or ""
    assert len(doc) > 80, floor
    if floor != "platform":
        assert "May import" in doc, floor


def test_the_module_map_of_the_architecture_doc_is_the_code():
    """docs/architecture.md names every module by its path under meshdsl/ (and under models/), and
    no module that is not."""
    text = (ROOT.parent / "docs" / "architecture.md").read_text()
    named = {p for p in re.findall(r"`((?:[a-z_]+/)*[a-z_0-9]+\.py)`", text)
             if not p.startswith("tests/") and p != "__init__.py"}
    for root, prefix in ((ROOT, ""), (MODELS_ROOT, "models/")):
        paths = {prefix + str(p.relative_to(root)) for p in root.rglob("*.py") if p.name != "__init__.py"}
        mine = {p for p in named if p.startswith("models/") == bool(prefix)}
        assert paths - mine == set(), sorted(paths - mine)
        assert mine - paths == set(), sorted(mine - paths)


def test_a_cycle_is_detected():  # the checker itself can fail
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_values_do_not_import_rules_backends_or_reports():
    graph = _graph()

    def reach(u, seen=None):
        seen = set() if seen is None else seen
        for v in graph[u]:
            if v not in seen:
                seen.add(v)
                reach(v, seen)
        return seen

    low = {"meshdsl.names.dims", "meshdsl.names.errors", "meshdsl.names.named", "meshdsl.names.mesh", "meshdsl.names.layout",
           "meshdsl.names.tracing", "meshdsl.costmodel.cost", "meshdsl.names.units", "meshdsl.platform.jaxcompat"}
    for name in low:
        assert reach(name) <= low, (name, sorted(reach(name) - low))


def test_no_import_inside_a_function_body():
    found = []
    for name, path in MODULES.items():
        for fn in ast.walk(ast.parse(path.read_text())):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or (path.name, fn.name) in LAZY_IMPORTS:
                continue
            for node in ast.walk(fn):
                if isinstance(node, (ast.Import, ast.ImportFrom)):
                    top = (node.module or "") if isinstance(node, ast.ImportFrom) else node.names[0].name
                    if getattr(node, "level", 0) or top.split(".")[0] not in OPTIONAL:
                        found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found


def test_jax_internals_are_used_in_one_module():
    users = sorted(p.name for p in MODULES.values() if "jax._src" in p.read_text())
    assert users == ["jaxcompat.py"], users


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_and_functions_are_small(name):
    path = MODULES[name]
    lines = path.read_text().splitlines()
    assert len(lines) <= 420, f"{path} has {len(lines)} lines: it holds two ideas, split it"
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            n = fn.end_lineno - fn.lineno + 1
            assert n <= 62, f"{path.name}: {fn.name} has {n} lines"


def test_the_facade_exports_the_contract_and_nothing_internal():
    contract = """Dim named shape NamedArray param einsum add multiply exp relu sum mean max softmax logsumexp
        rename reshape one_hot take top_k cumsum shift concat slice pad where random scan Mesh Layout
        lower explain LayoutError ShapeError MeshError MeshDSLError""".split()
    for name in contract:
        assert name in md.__all__ and hasattr(md, name), name
    assert set(md.__all__) <= set(dir(md))
    assert "Placement" not in md.__all__ and not hasattr(md, "Placement")
    assert md.random.normal and md.random.uniform and md.random.bernoulli
    from meshdsl import hlo_comm   # the measuring tool scripts from outside import by this name
    assert hlo_comm.analyze and hlo_comm.CommReport


def test_operators_and_views_are_installed_by_their_layers():
    x = md.named([1.0, 2.0], "a")
    assert (x + 1).names == ("a",) and (-x).names == ("a",) and x.astype("int32").dtype == "int32"
    assert "<table" in x._repr_html_()
    methods = [n.name for c in ast.walk(ast.parse((ROOT / "names" / "named.py").read_text()))
               if isinstance(c, ast.ClassDef) and c.name == "NamedArray" for n in c.body
               if isinstance(n, ast.FunctionDef)]
    assert "__add__" not in methods and "_repr_html_" not in methods and "astype" not in methods
