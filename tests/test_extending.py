"""docs/extending.md is true: each recipe's table lists exactly the package files its example touches.

Each recipe ends with ``Checked: the names `A`, `B` appear in exactly the files above (NAME is `x`)``: an
existing instance of what the recipe adds. Its *references* are the identifiers and string values in the
code (docstrings and comments left out, so prose that mentions a name does not count); the files of
`sharding`, `models`, `train` and `checkpoints` that hold any must be exactly those the recipe's tables list
(their first column; ``NAME`` in a path is the instance's module). A file the recipe forgets, or one it
lists that the instance never needed, fails here.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "extending.md"
PACKAGES = ("sharding", "models", "train", "checkpoints")
CHECKED = re.compile(r"^Checked: the names (.*?) appear in exactly the files above(?: \(NAME is `(\w+)`\))?\.$", re.M)


def recipes(text: str) -> dict[str, str]:
    """Recipe title (a ``## `` heading) -> its section's text."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}


def listed(body: str, name: str | None) -> set[str]:
    """The package files in the first column of a section's tables, ``NAME`` replaced by ``name``."""
    files = set()
    for cell in re.findall(r"^\| ([^|]+) \|", body, re.M):
        for path in re.findall(r"`([^`]+)`", cell):
            path = path.replace("NAME", name) if name else path
            if path.split("/")[0] in PACKAGES and path.endswith(".py"):
                files.add(path)
    return files


def references(source: str) -> set[str]:
    """Identifiers (names, attributes, imports, definitions) and string values of a module, docstrings and
    comments left out."""
    tree = ast.parse(source)
    docs = set()
    for node in ast.walk(tree):
        for stmt in getattr(node, "body", []) if isinstance(getattr(node, "body", None), list) else []:
            if (
                isinstance(stmt, ast.Expr)
                and isinstance(stmt.value, ast.Constant)
                and isinstance(stmt.value.value, str)
            ):
                docs.add(id(stmt.value))  # module, class, function and attribute docstrings
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            out.add(node.id)
        elif isinstance(node, ast.Attribute):
            out.add(node.attr)
        elif isinstance(node, ast.alias):
            out.update({node.name.split(".")[-1], node.asname or ""})
        elif isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            out.add(node.value)
    return out


def found(names: list[str]) -> set[str]:
    """The package files whose code refers to any of ``names``."""
    return {
        str(path.relative_to(ROOT))
        for package in PACKAGES
        for path in (ROOT / package).rglob("*.py")
        if references(path.read_text()) & set(names)
    }


def mismatch(body: str) -> dict[str, list[str]]:
    """What a recipe's tables leave out of, or add to, the files its Checked names are referred to in."""
    match = CHECKED.search(body)
    names = re.findall(r"`([^`]+)`", match.group(1))
    assert names, "the Checked line names nothing"
    want, have = listed(body, match.group(2)), found(names)
    return {"missing from the recipe": sorted(have - want), "listed but untouched": sorted(want - have)}


RECIPES = recipes(DOC.read_text())
CLEAN = {"missing from the recipe": [], "listed but untouched": []}


def test_every_recipe_is_checked():
    assert len(RECIPES) == 5
    assert [title for title, body in RECIPES.items() if not CHECKED.search(body)] == []


@pytest.mark.parametrize("title", sorted(RECIPES))
def test_recipe_lists_exactly_the_files_its_example_touches(title):
    assert mismatch(RECIPES[title]) == CLEAN


def test_a_wrong_table_fails():
    """The check can fail: a recipe that drops a file, or adds one its example never touches."""
    body = RECIPES["A device kind"]
    dropped = body.replace("| `sharding/devices/kinds.py` |", "| a note |")
    assert mismatch(dropped)["missing from the recipe"] == ["sharding/devices/kinds.py"]
    added = body.replace("| `sharding/devices/kinds.py` |", "| `sharding/devices/kinds.py`, `sharding/mesh.py` |")
    assert mismatch(added)["listed but untouched"] == ["sharding/mesh.py"]


def test_references_leave_out_docstrings_and_comments():
    source = '"""Mentions l40s."""\n# l40s here too\ndef f():\n    """And l40s."""\n    return "l40s"\n'
    assert "l40s" in references(source)
    assert "l40s" not in references(source.replace('return "l40s"', "return 1"))
