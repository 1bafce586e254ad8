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
