"""Package layering, checked on every import statement of the product code (function-local ones included):

    base          <- nothing of ours (the error type, method names, safe file writing, prompt files, prompt sets)
    models        <- base
    runtime       <- base, models
    export        <- base, models
    calibration   <- base, models
    training      <- base, models, runtime, export
    engines       <- base, models, runtime, export, calibration, training
    serving       <- base, models, runtime, engines
    the CLI layer (eaglex/*.py) <- everything

and no circle between modules, not even one held open by a function-local import: a local import is for a heavy or
optional dependency, never for two modules that need each other's names (move the shared names down instead); nor a
function-local import of a module the file already imports at the top, which defers nothing.

A new edge against these rules fails here, naming the file and the import."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("base", "models", "runtime", "export", "calibration", "training", "engines", "serving")
ALLOWED = {
    "base": {"base"},
    "models": {"base", "models"},
    "runtime": {"base", "models", "runtime"},
    "export": {"base", "models", "export"},
    "calibration": {"base", "models", "calibration"},
    "training": {"base", "models", "runtime", "export", "training"},
    "engines": {"base", "models", "runtime", "export", "calibration", "training", "engines"},
    "serving": {"base", "models", "runtime", "engines", "serving"},
    "cli": set(LAYERS) | {"cli"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["eaglex"] + (parts[1:] if parts[0] == "eaglex" else parts))


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "cli"


def imports(source: str | ast.AST, module: str) -> list[str]:
    """Every eaglex name `source` (text, or a parsed node) imports, top-level or function-local (relative imports
    resolved against `module`; `from a.b import c` names a.b and a.b.c, since c may be a module)."""
    out = []
    for node in ast.walk(ast.parse(source) if isinstance(source, str) else source):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: -node.level]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append(name)
            out += [f"{name}.{a.name}" for a in node.names]   # `from eaglex import bench` imports eaglex.bench
    return [m for m in out if m == "eaglex" or m.startswith("eaglex.")]


def violations(files: dict[str, str]) -> list[str]:
    """`files`: module name -> source. One line per import that breaks the layers."""
    bad = []
    for module, source in files.items():
        src = layer(module)
        for target in imports(source, module):
            if target == "eaglex" or target.split(".")[-1] == "__version__":
                continue
            if layer(target) not in ALLOWED[src]:
                bad.append(f"{module} ({src}) imports {target} ({layer(target)})")
    return bad


def owner(name: str, files: dict[str, str]) -> str | None:
    """The module of `files` that `name` (a module, or a name in one) lives in."""
    while name and name not in files:
        name = name.rpartition(".")[0]
    return name or None


def deferred_nothing(files: dict[str, str]) -> list[str]:
    """One line per function-local import of a module (not a package) the same file imports at the top."""
    functions = (ast.FunctionDef, ast.AsyncFunctionDef)
    bad = set()
    for module, source in files.items():
        tree = ast.parse(source)
        top = {owner(m, files) for node in tree.body if not isinstance(node, functions + (ast.ClassDef,))
               for m in imports(node, module)}
        for fn in (n for n in ast.walk(tree) if isinstance(n, functions)):
            for o in {owner(m, files) for m in imports(fn, module)}:
                if o in top and o != module and not any(k.startswith(o + ".") for k in files):
                    bad.add(f"{module}: {fn.name}() imports {o}, imported at the top already")
    return sorted(bad)


def graph(files: dict[str, str]) -> dict[str, set[str]]:
    """module -> the modules of `files` it imports, top-level and function-local alike (`from m import name` is an
    edge to m; the eaglex package itself, which imports nothing, is left out)."""
    edges = {}
    for module, source in files.items():
        targets = {owner(m, files) for m in imports(source, module)}
        edges[module] = {t for t in targets if t not in (None, "eaglex", module)}
    return edges


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Every circle of the graph, one per strongly connected component of more than one module (sorted)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:          # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(out)


def product_files() -> dict[str, str]:
    files = {}
    for top in ("eaglex",) + LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            files[module_name(path)] = path.read_text()
    return files


def test_product_code_follows_the_layers():
    assert violations(product_files()) == []


def test_no_import_circles_not_even_lazy_ones():
    assert circles(graph(product_files())) == []


def test_no_function_local_import_of_what_the_top_imports():
    assert deferred_nothing(product_files()) == []


def test_a_planted_pointless_local_import_fails():
    files = product_files()
    files["eaglex.runtime.batch"] += "\n\ndef _late():\n    from eaglex.base.errors import ModelError\n"
    files["eaglex.base.fsio"] += "\n\ndef _fine():\n    from eaglex.base import prompts\n"      # not at the top
    assert deferred_nothing(files) == [
        "eaglex.runtime.batch: _late() imports eaglex.base.errors, imported at the top already"]


def test_a_planted_upward_import_fails():
    files = product_files()
    files["eaglex.runtime.generate"] += "\n\ndef _bad():\n    from eaglex.engines.build import build_engine\n"
    files["eaglex.models.target"] += "\nfrom eaglex.runtime import types\n"
    files["eaglex.calibration.fp8"] += "\nimport eaglex.training.loop\n"
    files["eaglex.base.fsio"] += "\nfrom eaglex.runtime.manifest import MANIFEST\n"
    files["eaglex.base.prompts"] += "\n\ndef _bad():\n    from eaglex import presets\n"
    bad = violations(files)
    assert any("eaglex.runtime.generate (runtime) imports eaglex.engines.build" in b for b in bad), bad
    assert any("eaglex.models.target (models) imports eaglex.runtime" in b for b in bad), bad
    assert any("eaglex.calibration.fp8 (calibration) imports eaglex.training.loop" in b for b in bad), bad
    assert any("eaglex.base.fsio (base) imports eaglex.runtime.manifest" in b for b in bad), bad
    assert any("eaglex.base.prompts (base) imports eaglex.presets (cli)" in b for b in bad), bad


def test_a_planted_lazy_circle_fails():
    """A function-local import back into a module that imports this one at the top is a circle; so are two
    function-local imports of each other, and a longer ring through a package's relative import."""
    files = product_files()
    files["eaglex.base.prompts"] += "\n\ndef _dodge():\n    from eaglex.base import fsio\n"
    files["eaglex.base.fsio"] += "\nfrom eaglex.base.prompts import encode\n"
    files["eaglex.presets"] += "\n\ndef _a():\n    from eaglex import make_engine\n"
    files["eaglex.runtime.verify"] += "\n\ndef _b():\n    from . import sampling\n"
    files["eaglex.runtime.sampling"] += "\n\ndef _c():\n    from .verify import verify_greedy\n"
    found = circles(graph(files))
    assert ["eaglex.base.fsio", "eaglex.base.prompts"] in found, found
    assert ["eaglex.runtime.sampling", "eaglex.runtime.verify"] in found, found
    assert any("eaglex.make_engine" in c and "eaglex.presets" in c for c in found), found


def test_relative_imports_resolve():
    assert imports("from .manifest import MANIFEST\n", "eaglex.runtime.engine")[0] == "eaglex.runtime.manifest"
    assert imports("from ..runtime import types\n", "eaglex.serving.model.loader")[0] == "eaglex.serving.runtime"


def repeated_names(modules) -> list[str]:
    """Module base names that occur in more than one package (e.g. a runtime.request and a serving.request)."""
    by_name: dict[str, list[str]] = {}
    for m in modules:
        if not m.endswith("__init__") and m.count(".") >= 1:
            by_name.setdefault(m.rsplit(".", 1)[1], []).append(m)
    return sorted(f"{name}: {', '.join(sorted(ms))}" for name, ms in by_name.items() if len(ms) > 1)


def test_module_names_are_distinct_across_packages():
    """One name, one module: a reader (and a traceback) never has to ask which `request` or `quantize` is meant."""
    assert repeated_names(product_files()) == []
    assert repeated_names(["eaglex.runtime.request", "eaglex.serving.request", "eaglex.runtime.batch"]) == [
        "request: eaglex.runtime.request, eaglex.serving.request"]
