"""Package layering, checked on every import statement of the product code (function-local ones included):

    leaves (eaglex.fsio, eaglex.prompts, eaglex.chat_prompts, eaglex.honest_prompts, eaglex.models.errors): import
                  only leaves
    models        <- nothing of ours but leaves
    runtime       <- models
    export        <- models
    calibration   <- models
    training      <- models, runtime, export
    engines       <- models, runtime, export, calibration, training
    serving       <- models, runtime, engines
    the CLI layer (eaglex/*.py) <- everything

A new edge against these rules fails here, naming the file and the import."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ("models", "runtime", "export", "calibration", "training", "engines", "serving")
LEAVES = {"eaglex.fsio", "eaglex.prompts", "eaglex.chat_prompts", "eaglex.honest_prompts", "eaglex.models.errors"}
ALLOWED = {
    "models": {"models"},
    "runtime": {"models", "runtime"},
    "export": {"models", "export"},
    "calibration": {"models", "calibration"},
    "training": {"models", "runtime", "export", "training"},
    "engines": {"models", "runtime", "export", "calibration", "training", "engines"},
    "serving": {"models", "runtime", "engines", "serving"},
    "leaf": set(),
    "cli": set(LAYERS) | {"cli"},
}


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["eaglex"] + (parts[1:] if parts[0] == "eaglex" else parts))


def layer(module: str) -> str:
    if module in LEAVES:
        return "leaf"
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else "cli"


def imports(source: str, module: str) -> list[str]:
    """Every eaglex module `source` imports (relative imports resolved against `module`)."""
    out = []
    for node in ast.walk(ast.parse(source)):
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
    """`files`: module name -> source. One line per import that breaks the rules."""
    bad = []
    for module, source in files.items():
        src = layer(module)
        for target in imports(source, module):
            if target == "eaglex" or target.split(".")[-1] == "__version__":
                continue
            dst = layer(target)
            if dst == "leaf" or dst == src and src != "leaf":
                continue
            if target not in files and ".".join(target.split(".")[:-1]) in files:
                dst = layer(".".join(target.split(".")[:-1]))          # `from pkg.mod import name`
                if dst == "leaf" or dst == src and src != "leaf":
                    continue
            if dst not in ALLOWED[src]:
                bad.append(f"{module} ({src}) imports {target} ({dst})")
    return bad


def product_files() -> dict[str, str]:
    files = {}
    for top in ("eaglex",) + LAYERS:
        for path in (ROOT / top).rglob("*.py"):
            files[module_name(path)] = path.read_text()
    return files


def test_product_code_follows_the_layers():
    assert violations(product_files()) == []


def test_a_planted_upward_import_fails():
    files = product_files()
    files["eaglex.runtime.generate"] += "\n\ndef _bad():\n    from eaglex.engines.build import build_engine\n"
    files["eaglex.models.target"] += "\nfrom eaglex.runtime import types\n"
    files["eaglex.calibration.fp8"] += "\nimport eaglex.training.loop\n"
    files["eaglex.fsio"] += "\nfrom eaglex.runtime.manifest import MANIFEST\n"
    bad = violations(files)
    assert any("eaglex.runtime.generate (runtime) imports eaglex.engines.build" in b for b in bad), bad
    assert any("eaglex.models.target (models) imports eaglex.runtime" in b for b in bad), bad
    assert any("eaglex.calibration.fp8 (calibration) imports eaglex.training.loop" in b for b in bad), bad
    assert any("eaglex.fsio (leaf) imports eaglex.runtime.manifest" in b for b in bad), bad


def test_relative_imports_resolve():
    assert imports("from .manifest import MANIFEST\n", "eaglex.runtime.engine")[0] == "eaglex.runtime.manifest"
    assert imports("from ..runtime import types\n", "eaglex.serving.model.loader")[0] == "eaglex.serving.runtime"
