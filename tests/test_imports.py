"""Imports run one way (docs/conventions.md): every module's imports, function-level ones included.

``train -> {checkpoints, models, sharding}``, ``checkpoints -> {models.config, sharding}``,
``models -> sharding``; ``sharding`` and ``models/kernels`` import nothing of ours (but themselves).
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("sharding", "models", "train", "checkpoints")

# Package (the longest matching prefix wins) -> the modules of ours it may import, as prefixes.
ALLOWED = {
    "sharding": ("sharding",),
    "models.kernels": ("models.kernels",),
    "models": ("models", "sharding"),
    "checkpoints": ("checkpoints", "models.config", "sharding"),
    "train": ("train", "checkpoints", "models", "sharding"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every import in the file, wherever it sits; relative ones resolved;
    ``from X import Y`` counted as ``X.Y`` (Y may be a module)."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            out += [(node.lineno, f"{base}.{alias.name}" if base else alias.name) for alias in node.names]
    return out


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def _rule(module: str) -> tuple[str, ...]:
    owner = max((p for p in ALLOWED if _within(module, p)), key=len)
    return ALLOWED[owner]


def wrong_way(path: Path) -> list[str]:
    """``file:line imports X`` for each import of ours that the rules forbid."""
    module = _module_name(path)
    allowed = _rule(module)
    return [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for line, name in _imports(path)
        if _ours(name) and not any(_within(name, p) for p in allowed)
    ]


FILES = sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path):
    assert wrong_way(path) == []


def test_the_check_catches_a_wrong_import(tmp_path, monkeypatch):
    """A sharding module importing the model, at function level, and a kernel importing sharding."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "sharding").mkdir()
    (tmp_path / "models" / "kernels").mkdir(parents=True)
    bad = tmp_path / "sharding" / "bad.py"
    bad.write_text("import math\n\ndef f():\n    from models.config import ModelConfig\n    return ModelConfig\n")
    kernel = tmp_path / "models" / "kernels" / "k.py"
    kernel.write_text("from sharding import axes\nfrom .flash_attention import flash_attention\n")
    fine = tmp_path / "models" / "m.py"
    fine.write_text("from sharding import axes\nfrom .config import ModelConfig\n")
    assert wrong_way(bad) == ["sharding/bad.py:4 imports models.config.ModelConfig"]
    assert wrong_way(kernel) == ["models/kernels/k.py:1 imports sharding.axes"]
    assert wrong_way(fine) == []
    assert len(FILES) > 30


# Modules that must import without JAX (docs/conventions.md): the device table, cluster specs and
# files, and the detection module (which imports JAX only when asked for the live devices). Add
# `sharding.pipeline.layout` once `sharding/pipeline/__init__.py` imports no schedule.
JAX_FREE = (
    "sharding.devices",
    "sharding.devices.kinds",
    "sharding.devices.inventory",
    "sharding.devices.spec",
    "sharding.devices.detect",
)


def _import_without_jax(module: str, path: Path = ROOT) -> subprocess.CompletedProcess:
    code = f"import sys; sys.modules['jax'] = None; import {module}"  # None makes `import jax` raise
    return subprocess.run([sys.executable, "-c", code], cwd=path, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("module", JAX_FREE)
def test_pure_modules_import_without_jax(module):
    result = _import_without_jax(module)
    assert result.returncode == 0, result.stderr


def test_the_jax_free_check_catches_a_jax_import(tmp_path):
    (tmp_path / "uses_jax.py").write_text("import json\n\nimport jax\n")
    result = _import_without_jax("uses_jax", tmp_path)
    assert result.returncode != 0 and "import of jax halted" in result.stderr


# One way inside each package too: the module-level imports of a package form no circle, and a function-local import of
# ours says why it is not at the top (an optional dependency, or a module slow to import).
TRAIN = ROOT / "train"
LOCAL_IMPORT_REASONS = ("# optional:", "# slow:")


def _module_level_imports(path: Path) -> list[str]:
    """The modules of ours ``path`` imports at module level (in `if` and `try` blocks too, not in functions);
    ``from X import Y`` counted as ``X.Y`` when that is a module of ours, else as ``X``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, ast.Import):
                out.extend(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                out.extend(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names
                )
            elif isinstance(node, (ast.If, ast.Try)):
                visit(node.body)
                visit(getattr(node, "orelse", []))
                visit([n for handler in getattr(node, "handlers", []) for n in handler.body])
                visit(getattr(node, "finalbody", []))

    visit(ast.parse(path.read_text(), str(path)).body)
    return out


def import_graph(root: Path) -> dict[str, set[str]]:
    """``module -> the modules of root's package it imports at module level``. Importing ``a.b.c`` runs the
    packages ``a.b`` and ``a`` first, so each import also counts its packages, except those that hold the
    importer itself (a package's ``__init__`` importing its own modules is no circle)."""
    modules = {_module_name(p): p for p in sorted(root.rglob("*.py"))}
    graph = {}
    for module, path in modules.items():
        edges = set()
        for name in _module_level_imports(path):
            while name and name not in modules:
                name = name.rpartition(".")[0]
            parts = name.split(".") if name else []
            for i in range(1, len(parts) + 1):
                target = ".".join(parts[:i])
                if target in modules and target != module and not _within(module, target):
                    edges.add(target)
        graph[module] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The circles of ``graph``, one per strongly connected component of more than one module (Tarjan's
    algorithm), each as a path through the component that returns to its first module."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                connect(w)
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
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    cycles = []
    for component in components:
        start = min(component)
        path, seen = [start], {start}
        while True:  # walk inside the component until a module repeats
            step = min(w for w in graph[path[-1]] if w in component)
            if step in seen:
                cycles.append(path[path.index(step) :] + [step])
                break
            path.append(step)
            seen.add(step)
    return sorted(cycles)


def local_imports_without_reason(path: Path) -> list[str]:
    """``file:line imports X`` for each import of ours inside a function with no comment on its line or the
    line before saying why it is not at the top (`LOCAL_IMPORT_REASONS`)."""
    lines = path.read_text().splitlines()
    out = []
    for function in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(function, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for node in function.body:
            for sub in ast.walk(node):
                if isinstance(sub, ast.Import):
                    names = [alias.name for alias in sub.names]
                elif isinstance(sub, ast.ImportFrom) and not sub.level:
                    names = [sub.module]
                else:
                    continue
                said = lines[sub.end_lineno - 1] + (lines[sub.lineno - 2] if sub.lineno > 1 else "")
                if any(_ours(n) for n in names) and not any(reason in said for reason in LOCAL_IMPORT_REASONS):
                    out.append(f"{path.relative_to(ROOT)}:{sub.lineno} imports {', '.join(names)}")
    return sorted(set(out))


MODULES = {_module_name(p) for p in FILES}


def test_train_imports_form_no_circle():
    assert import_cycles(import_graph(TRAIN)) == []


# The other packages too: a package's circles stay inside it (the one-way rules above forbid the rest).
@pytest.mark.parametrize("package", [p for p in PACKAGES if p != "train"])
def test_package_imports_form_no_circle(package):
    assert import_cycles(import_graph(ROOT / package)) == []


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_function_local_imports_say_why(path):
    assert local_imports_without_reason(path) == []


def test_the_circle_and_local_import_checks_catch_them(tmp_path, monkeypatch):
    """Three modules in a circle (one through a package's ``__init__``) and a local import with and without
    its reason."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    package = tmp_path / "train"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from train.sub import leaf\n")
    (package / "sub" / "leaf.py").write_text("import math\n")
    (package / "a.py").write_text("from train import b\n")
    (package / "b.py").write_text("import train.c\n")
    (package / "c.py").write_text(
        "from train.sub.leaf import x\n\n\ndef f():\n    from train import a\n\n    # slow: a\n    import train.a\n"
    )
    (package / "sub" / "leaf.py").write_text("import math\n\nfrom train.a import y\n")
    monkeypatch.setattr(sys.modules[__name__], "MODULES", {_module_name(p) for p in package.rglob("*.py")})
    graph = import_graph(package)
    assert graph["train.c"] == {"train.sub", "train.sub.leaf"}
    assert import_cycles(graph) == [["train.a", "train.b", "train.c", "train.sub", "train.sub.leaf", "train.a"]]
    assert local_imports_without_reason(package / "c.py") == ["train/c.py:5 imports train"]
