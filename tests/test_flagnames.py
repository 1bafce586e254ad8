"""Library errors name configuration fields; the command line prints them with its flags, as before.

`sharding`, `models` and `checkpoints` never spell a flag: their errors (`sharding.errors.ConfigError`) carry
field references, which ``str()`` writes as the library's names and `train.setup.flagnames.render` as the flags a
user types. These tests pin both renderings of a few representative errors, and scan the library's source
for a flag written into a string.
"""

import ast
import re
from pathlib import Path

import pytest

from models.config import get_config, parse_overrides
from models.generation import Sampling
from sharding.errors import ConfigError, Field, FieldText, Override, with_context
from sharding.mesh import parse_axis_sizes
from sharding.pipeline import check_microbatches, plan_layout
from sharding.rules import parse_rule_overrides
from train.setup.flagnames import FLAGS, flag_text, render

ROOT = Path(__file__).resolve().parent.parent
LIBRARY = ("sharding", "models", "checkpoints")


def _raised(call, *args, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        call(*args, **kwargs)
    return info.value


def test_fewer_layers_than_stages_names_the_mesh_and_the_layer_count():
    error = _raised(plan_layout, 2, 4)
    assert render(error) == (
        "--mesh stage=4: the model has 2 layers, fewer than the 4 stages; use --mesh stage=2 "
        "(or more layers, --set num_layers=4)"
    )
    assert str(error) == (
        "mesh stage=4: the model has 2 layers, fewer than the 4 stages; use mesh stage=2 (or more layers, num_layers=4)"
    )


def test_stage_layers_that_do_not_sum_name_the_field_and_an_even_split():
    error = _raised(plan_layout, 12, 4, 1, (5, 3, 2, 1))
    assert (
        render(error) == "--stage-layers 5,3,2,1 sums to 11, but the model has 12 layers; e.g. --stage-layers 3,3,3,3"
    )
    assert str(error) == "stage_layers=5,3,2,1 sums to 11, but the model has 12 layers; e.g. stage_layers=3,3,3,3"


def test_a_model_field_is_an_override_on_the_command_line():
    error = _raised(get_config, "test", ["rope_type=yarn"])
    assert render(error) == "--set rope_type=yarn: choose one of default, llama3; e.g. --set rope_type=default"
    assert str(error) == "rope_type=yarn: choose one of default, llama3; e.g. rope_type=default"
    typo = _raised(parse_overrides, ["num_layer=4"])
    assert render(typo).startswith("--set 'num_layer=4': unknown field 'num_layer'; e.g. --set num_layers=4 (fields")
    assert str(typo).startswith("override 'num_layer=4': unknown field 'num_layer'; e.g. num_layers=4 (fields")


def test_the_planner_batch_is_its_own_field():
    error = _raised(check_microbatches, 1, 2, 8, 1, batch_field="global_batch")
    assert render(error) == (
        "--microbatches 1: fewer microbatches than the 2 pipeline stages (--mesh stage=2); every stage needs a "
        "microbatch in flight; use --microbatches 2"
    )
    error = _raised(check_microbatches, 3, 4, 6, 2, batch_field="global_batch")
    assert render(error).endswith("use --microbatches 4 --batch 8")
    assert str(error).endswith("use microbatches=4 global_batch=8")


def test_mesh_errors_name_the_field_they_parse():
    error = _raised(parse_axis_sizes, "data=-1", field="mesh_outer", allow_fill=False)
    assert render(error) == (
        "--mesh-outer 'data=-1': size -1 of axis 'data' must be a positive integer "
        "(example: --mesh-outer data=2,fsdp=-1,tensor=2)"
    )
    assert str(error).startswith("mesh_outer 'data=-1': ")


def test_rules_and_sampling_errors():
    error = _raised(parse_rule_overrides, ["mlp"])
    assert render(error) == "--rule 'mlp': expected NAME=AXIS[+AXIS], e.g. --rule mlp=tensor+fsdp"
    assert str(error) == "rule='mlp': expected NAME=AXIS[+AXIS], e.g. rule mlp=tensor+fsdp"
    assert render(_raised(Sampling, top_p=0)) == "--top-p 0: must be in (0, 1], e.g. 0.9"


def test_context_added_by_a_caller_keeps_the_fields():
    with pytest.raises(ValueError) as info:
        get_config("test", num_layers=0)
    wrapped = with_context(info.value, "config.json: ")
    assert isinstance(wrapped, ConfigError)
    assert render(wrapped) == "config.json: --set num_layers=0: must be a positive integer"
    plain = with_context(ValueError("not JSON"), "config.json: ", ".")
    assert type(plain) is ValueError and str(plain) == "config.json: not JSON."


def test_a_note_that_names_fields_is_text_both_ways():
    _, note = plan_layout(6, 4)
    assert isinstance(note, FieldText) and note.startswith("stage_layers not given: 6 layers")
    assert render(note).startswith("--stage-layers not given: 6 layers")
    assert render("plain text") == "plain text"


def test_field_text_without_a_flag_stays_the_library_name():
    assert flag_text(Field("stage_layers")) == "--stage-layers"
    assert flag_text(Override("num_heads")) == "--set num_heads"
    assert flag_text(Field("tick_schedule", "'x'")) == "tick_schedule='x'"
    assert str(Field("mesh", "stage=4")) == "mesh stage=4"


def _field_names(tree: ast.AST) -> set[str]:
    """The constant names of every ``Field(...)`` a module's source builds."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "Field" and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str):
                names.add(first.value)
    return names


def _sources(*packages: str):
    for package in packages:
        for path in sorted((ROOT / package).rglob("*.py")):
            yield path, ast.parse(path.read_text(encoding="utf-8"))


def test_every_field_the_library_names_has_a_flag():
    named = set()
    for _, tree in _sources(*LIBRARY):
        named |= _field_names(tree)
    assert named, "no Field(...) found: the scan is broken"
    assert not named - set(FLAGS), f"fields without a flag in train.setup.flagnames.FLAGS: {sorted(named - set(FLAGS))}"


FLAG = re.compile(r"(?<![\w-])--(?:[a-z][a-z0-9-]*|$)")
"""A flag written into a string: ``--name``, or ``--`` just before an f-string's replacement field."""


def _docstrings(tree: ast.AST) -> set[int]:
    """The ids of the string constants that are docstrings (of modules, classes, functions, attributes)."""
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        for statement in body if isinstance(body, list) else ():
            if (
                isinstance(statement, ast.Expr)
                and isinstance(statement.value, ast.Constant)
                and isinstance(statement.value.value, str)
            ):
                found.add(id(statement.value))
    return found


COMMAND_LINE_MODULES = ("checkpoints/inspect.py", "checkpoints/argparser.py")
"""Command-line code kept in ``checkpoints``: ``python -m checkpoints.inspect`` (its parser and its own
error lines) and the argument parser every entry point shares; they speak flags by purpose."""


@pytest.mark.parametrize("package", LIBRARY)
def test_library_strings_spell_no_flag(package):
    """A string in the code (a message, a default) that names a flag ties the library to the command line;
    docstrings and comments may still say which flag sets a field, for a reader."""
    hits = []
    for path, tree in _sources(package):
        if str(path.relative_to(ROOT)) in COMMAND_LINE_MODULES:
            continue
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
                if FLAG.search(node.value):
                    hits.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value[:60]!r}")
    assert not hits, "flags in library strings (name the field, sharding.errors.Field):\n" + "\n".join(hits)
