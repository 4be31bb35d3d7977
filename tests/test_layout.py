"""The package's shape, read from the source with `ast` (no jax), so a change that breaks it
fails here naming the file: small modules formatted by ruff alone, few top-level modules, no
import cycle, folders that import only the folders below them, generic code that names no
model parameter, models that know nothing of memory management. Every name a check guards
must exist: a guard for a name that is gone fails too, so the checks cannot decay.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from helpers import ROOT

PACKAGE = ROOT / "jaxpod"
MAX_LINES = 400
MAX_TOP_LEVEL = 3  # modules directly under jaxpod/ besides __init__/__main__ and the folders
# A model's own parameter names (GPT's and BERT's; EfficientNet's are stored as dtype rows):
# generic code reads parameter roles from the metadata instead.
MODEL_PARAMETER_NAMES = {
    *("w_qkv", "w_o", "w_in", "w_out", "w_head", "b_qkv", "b_o", "b_in", "b_out", "b_head"),
    *("ln1", "ln2", "ln_emb", "ln_f", "ln_head", "wte", "wpe", "wtt", "unembed"),
}
NOT_FOR_MODELS = ("jaxpod.parallel.replica", "jaxpod.parallel.offload", "jaxpod.engine")

# The folders (and top-level modules) from the bottom up: each may import those before it.
LAYERS = (
    *("errors", "platform", "config", "data", "optim", "parallel", "models", "target"),
    *("planner", "engine", "figures", "run", "inspect", "cli", "__main__"),
)
# The imports that go up (module -> module it imports): none; a new one is a loop to end.
BACK_ARROWS: set = set()


def modules() -> dict[str, Path]:
    """`{"jaxpod.run.loop": path, "jaxpod.planner": path/__init__.py, ...}`."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def module_imports(name: str, path: Path, known: set[str], anywhere: bool = False) -> set[str]:
    """The jaxpod modules `name` imports when it is imported (its module-level statements), or
    with `anywhere` in any statement (inside functions too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree) if anywhere else tree.body:
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets = [f"{base}.{a.name}" for a in node.names] + [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def test_no_module_is_over_400_lines():
    long = {
        str(p.relative_to(ROOT)): n
        for p in PACKAGE.rglob("*.py")
        if (n := len(p.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these modules (at most {MAX_LINES} lines): {long}"


MAX_FUNCTION_LINES = 60


def test_no_function_is_over_60_lines():
    """A function fits a screen (its `def` to its last line, nested functions included)."""
    long = {
        f"{p.relative_to(ROOT)}:{node.name}": node.end_lineno - node.lineno + 1
        for p in PACKAGE.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    }
    assert not long, f"split these functions (at most {MAX_FUNCTION_LINES} lines): {long}"


def test_ruff_alone_formats_the_code():
    """No formatter escapes (`fmt` comments that skip a line or turn formatting off) in the
    package, the tests or the benchmarks: a line never escapes the formatter (e.g. to fit a
    cap). The notebooks' sources keep their cells as written."""
    marks = tuple(f"# fmt: {word}" for word in ("skip", "off"))
    files = [p for top in (PACKAGE, ROOT / "tests", ROOT / "benchmarks") for p in top.rglob("*.py")]
    hits = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in files
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if any(mark in line for mark in marks)
    ]
    assert not hits, f"let ruff format these lines: {hits}"


def test_few_top_level_modules():
    entry = ("__init__.py", "__main__.py")
    top = sorted(p.name for p in PACKAGE.glob("*.py") if p.name not in entry)
    assert len(top) <= MAX_TOP_LEVEL, top


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """A cycle of `graph` (module -> the modules it imports) as a path, or None. An import of
    `a.b.c` runs the packages `a.b` first, so they count as imported too, except the module itself
    and its own packages (they are already being imported when it is)."""
    graph = {
        name: {p for d in deps for p in _with_packages(d) if not f"{name}.".startswith(f"{p}.")}
        for name, deps in graph.items()
    }
    done: set[str] = set()
    path: list[str] = []

    def visit(name: str) -> list[str] | None:
        if name in path:
            return path[path.index(name) :] + [name]
        if name in done:
            return None
        path.append(name)
        for dep in sorted(graph.get(name, ())):
            if cycle := visit(dep):
                return cycle
        path.pop()
        done.add(name)
        return None

    return next((c for name in sorted(graph) if (c := visit(name))), None)


def _with_packages(module: str) -> list[str]:
    """`jaxpod.run.loop` -> [`jaxpod.run.loop`, `jaxpod.run`] (the root package left out)."""
    parts = module.split(".")
    return [".".join(parts[:k]) for k in range(len(parts), 1, -1)]


def test_no_import_cycle():
    mods = modules()
    graph = {name: module_imports(name, path, set(mods)) for name, path in mods.items()}
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_check_finds_a_cycle(tmp_path):
    """The reader and the search behind `test_no_import_cycle` on a made-up package."""
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text("from jaxpod.x.b import f\n")
    b.write_text("import jaxpod.x.a\n\ndef f():\n    import jaxpod.x.c\n")
    known = {"jaxpod.x", "jaxpod.x.a", "jaxpod.x.b", "jaxpod.x.c"}
    graph = {
        "jaxpod.x.a": module_imports("jaxpod.x.a", a, known),
        "jaxpod.x.b": module_imports("jaxpod.x.b", b, known),
    }
    assert graph == {"jaxpod.x.a": {"jaxpod.x.b"}, "jaxpod.x.b": {"jaxpod.x.a"}}
    assert module_imports("jaxpod.x.b", b, known, anywhere=True) == {"jaxpod.x.a", "jaxpod.x.c"}
    assert find_cycle(graph) == ["jaxpod.x.a", "jaxpod.x.b", "jaxpod.x.a"]
    assert find_cycle({"jaxpod.x.a": {"jaxpod.x.b"}, "jaxpod.x.b": set()}) is None
    # a package whose __init__ imports a module that imports the package back
    assert find_cycle({"jaxpod.p": {"jaxpod.q.m"}, "jaxpod.q.m": {"jaxpod.p"}}) is not None


def _string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text())
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    ]


def _model_attributes() -> set[str]:
    """Every `self.<name> = ...` in jaxpod/models/: the models' submodules and parameters."""
    names = set()
    for p in (PACKAGE / "models").rglob("*.py"):
        for node in ast.walk(ast.parse(p.read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else []
            names |= {
                t.attr
                for t in targets
                if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"
            }
    return names


def test_generic_code_names_no_model_parameter():
    """Outside `jaxpod/models/`, no string literal is one of a model's parameter names, and
    each of those names is still a model's."""
    assert MODEL_PARAMETER_NAMES <= _model_attributes(), MODEL_PARAMETER_NAMES - _model_attributes()
    hits = [
        f"{p.relative_to(ROOT)}:{line} {value!r}"
        for p in PACKAGE.rglob("*.py")
        if "models" not in p.relative_to(PACKAGE).parts
        for line, value in _string_constants(p)
        if value in MODEL_PARAMETER_NAMES
    ]
    assert not hits, hits


def test_the_engine_and_parallel_name_no_model():
    """`engine/` and `parallel/` reach a model through `jaxpod.models.family` only: no model
    family's name in their code or text, and no import of a model's module."""
    families = ("gpt", "bert", "efficientnet", "mlm")
    hits = [
        f"{p.relative_to(ROOT)}:{n}"
        for folder in ("engine", "parallel")
        for p in (PACKAGE / folder).rglob("*.py")
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if any(re.search(rf"\b{f}\b", line, re.I) for f in families)
    ]
    assert not hits, hits


def test_models_import_no_memory_management():
    mods = modules()
    assert all(any(m.startswith(n) for m in mods) for n in NOT_FOR_MODELS), NOT_FOR_MODELS
    bad = {
        name: sorted(
            d
            for d in module_imports(name, path, set(mods), anywhere=True)
            if d.startswith(NOT_FOR_MODELS)
        )
        for name, path in mods.items()
        if name.startswith("jaxpod.models")
    }
    assert not {k: v for k, v in bad.items() if v}, bad


def layer(module: str) -> str | None:
    """`jaxpod.run.loop` -> `run`, `jaxpod.cli` -> `cli`; None for the root package."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_no_folder_imports_one_above_it():
    """Every import, at module level or inside a function, goes down `LAYERS` or stays in its
    folder; the only ones going up are `BACK_ARROWS`, each still there."""
    mods = modules()
    present = {layer(m) for m in mods} - {None}
    assert present == set(LAYERS), (
        f"place in LAYERS: {present - set(LAYERS)}; gone: {set(LAYERS) - present}"
    )
    rank = {name: i for i, name in enumerate(LAYERS)}
    up = {
        (name, dep)
        for name, path in mods.items()
        for dep in module_imports(name, path, set(mods), anywhere=True)
        if layer(name) and layer(dep) and rank[layer(dep)] > rank[layer(name)]
    }
    assert up <= BACK_ARROWS, (
        f"imports from a folder up to one above it: {sorted(up - BACK_ARROWS)}"
    )
    assert BACK_ARROWS <= up, f"gone, remove from BACK_ARROWS: {sorted(BACK_ARROWS - up)}"
