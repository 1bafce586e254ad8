"""List what a checkpoint folder holds: ``python -m checkpoints.inspect DIR [--step N] [--deep]``.

Prints the saved steps, marking those that do not read completely (with what
is missing), then for one step (default: the newest complete one) the mesh
and rules it was saved from, the data position, and each array's shape, dtype
and bytes. Reads metadata only unless ``--deep``, which also reads every
chunk of every array of every step (`checkpoints.verify.read_problems`) and
names each array, chunk and data file that does not decode; no device is
used either way. Exit status: 0 when every step reads completely, 1 when the
report lists a damaged step (so a script's ``--deep`` check fails on damage),
2 when nothing can be reported (one ``error:`` line).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np

from checkpoints.argparser import Parser
from checkpoints.verify import CheckpointDamaged, saved_steps, verify_step
from sharding.mesh import format_mesh
from sharding.pipeline.storage import StageStorage, layout_from_meta


def _resolve_dir(path: Path) -> Path:
    """Accepts a run folder (with ``checkpoints/`` inside) or the checkpoint folder itself."""
    if (path / "checkpoints").is_dir():
        return path / "checkpoints"
    return path


def _leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}/{key}" if prefix else str(key))
    elif isinstance(tree, (list, tuple)):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}/{i}" if prefix else str(i))
    elif tree is not None:
        yield prefix, tree


def _as_tree(metadata):
    """Orbax's metadata tree as nested dicts/lists (across Orbax versions)."""
    tree = getattr(metadata, "tree", metadata)
    return tree


def array_rows(metadata) -> list[tuple[str, tuple[int, ...], str, int]]:
    """``(path, shape, dtype, bytes)`` for every saved array."""
    rows = []
    for path, leaf in _leaves(_as_tree(metadata)):
        shape = tuple(getattr(leaf, "shape", ()) or ())
        dtype = getattr(leaf, "dtype", None)
        if dtype is None:
            continue
        nbytes = math.prod(shape) * np.dtype(dtype).itemsize
        rows.append((path, shape, str(np.dtype(dtype)), nbytes))
    return rows


def describe(directory: str | Path, step: int | None = None, deep: bool = False) -> list[str]:
    """The report lines for a checkpoint folder; damaged steps are marked, not read.

    Every step is verified first (`checkpoints.verify.verify_step`: metadata
    parsed, the array index walked, data files present; with ``deep`` every
    array read too, else no array data read), and each damaged one gets a
    line naming what is missing or does not decode. Without
    ``step`` the newest step that verifies is described. Nothing is written
    or removed (no Orbax manager is opened, so a save in progress is left alone).

    Raises:
      FileNotFoundError: when the folder does not exist (or is a file) or holds no checkpoint.
      checkpoints.verify.CheckpointDamaged: when ``step`` (or, without it,
        every step) does not read completely.
    """
    import orbax.checkpoint as ocp

    root = _resolve_dir(Path(directory).absolute())  # Orbax refuses relative paths
    if root.is_file():  # a file of a checkpoint (its metadata, say) given for its run
        run = next((str(p) for p in Path(directory).parents if (p / "checkpoints").is_dir()), None)
        inside = f", e.g. the run it is in, {run}" if run else ""
        raise FileNotFoundError(f"{directory}: a file, not a folder; give a run folder (with checkpoints/){inside}")
    if not root.is_dir():
        raise FileNotFoundError(f"{directory}: no such folder")
    steps = saved_steps(root)
    if not steps:
        hint = ""
        if root.name.isdigit():
            hint = f"; for one step of a run give the run folder and --step, e.g. {root.parent} --step {root.name}"
        raise FileNotFoundError(f"{root}: no complete checkpoint{hint}")
    if step is not None and step not in steps:
        raise FileNotFoundError(f"{root}: no step {step}; saved steps are {steps}")
    verdicts = {s: verify_step(root, s, deep=deep) for s in steps}
    damaged = [v for v in verdicts.values() if not v.ok]
    good = [s for s in steps if verdicts[s].ok]
    if step is None and not good:
        raise CheckpointDamaged(f"no step in {root} reads completely; newest: {damaged[-1].line()}")
    step = good[-1] if step is None else step
    if not verdicts[step].ok:
        ok_hint = f"; --step {good[-1]} reads completely" if good else ""
        raise CheckpointDamaged(f"{verdicts[step].line()}{ok_hint}")
    marked = [f"{s} (damaged)" if not verdicts[s].ok else str(s) for s in steps]
    meta = json.loads((root / str(step) / "meta" / "metadata").read_text())
    rows = array_rows(ocp.StandardCheckpointHandler().metadata(root / str(step) / "state"))
    checked = "every array read" if deep else "array data not read (--deep reads it)"
    lines = [f"checkpoints in {root}: steps {', '.join(marked)}; {checked}"]
    lines += [f"  {v.line()}" for v in damaged]
    lines.append(f"step {step}:")
    if "mesh" in meta:
        lines.append(f"  saved on mesh   {format_mesh(meta['mesh'])}")
    if "rules" in meta:
        lines.append(f"  rules           {meta['rules'].get('name')}")
    if meta.get("pipeline"):
        lines.append(f"  stage layout    {stage_layout_line(meta['pipeline'])}")
    if "preset" in meta:
        lines.append(f"  model           {meta['preset']} {meta.get('model', {})}")
    if "data" in meta:
        lines.append(f"  data position   {meta['data'].get('samples')} samples of {meta['data'].get('spec')}")
    if "tokenizer" in meta:
        lines.append(
            f"  tokenizer       {meta['tokenizer'].get('name')} ({meta['tokenizer'].get('vocab_size')} tokens)"
        )
    width = max((len(r[0]) for r in rows), default=10)
    lines.append(f"  {'array'.ljust(width)}  {'shape':<20} {'dtype':<8} bytes")
    for path, shape, dtype, nbytes in rows:
        lines.append(f"  {path.ljust(width)}  {str(shape):<20} {dtype:<8} {nbytes:,}")
    lines.append(f"  total {sum(r[3] for r in rows):,} bytes in {len(rows)} arrays")
    return lines


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``python -m checkpoints.inspect`` (also read by the flags reference generator)."""
    parser = Parser(prog="python -m checkpoints.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a run folder or its checkpoints/ folder")
    parser.add_argument("--step", type=int, default=None, help="which step (default: the latest)")
    parser.add_argument(
        "--deep",
        action="store_true",
        help="also read every array of every step (costs a read of the whole folder) and report "
        "those whose data does not decode",
    )
    return parser


def stage_layout_line(pipeline: dict) -> str:
    """What a checkpoint's ``pipeline`` metadata says of its layer arrays' leading dimension.

    Args:
      pipeline: the metadata's ``pipeline`` entry (`sharding.pipeline.StageStorage.to_meta`, or a padded
        `sharding.pipeline.StageLayout.to_meta` of checkpoints saved before unpadded storage).

    Returns:
      E.g. ``'2,2 (1 chunk per stage); layer arrays are [rows, ...]: 8 rows over stage=2 x 4 devices
      (unpadded), re-laid on resume'``.
    """
    stored = layout_from_meta(pipeline)
    if isinstance(stored, StageStorage):
        return (
            f"{stored.layout.describe()}; layer arrays are [rows, ...]: {stored.rows} rows over "
            f"stage={stored.stages} x {stored.groups} devices (unpadded), re-laid on resume"
        )
    return f"{stored.describe()}; layer arrays are [stage, slot, ...] (padded), re-laid on resume"


def main(argv: list[str] | None = None) -> int:
    """Prints the report; returns 0 (every step reads), 1 (a step is damaged) or 2 (no report: one error line)."""
    args = build_parser().parse_args(argv)
    try:
        lines = describe(args.directory, args.step, args.deep)
    except Exception as e:  # every failure is one line, never a traceback
        text = str(e).strip().splitlines()
        print(f"error: {text[0] if text else e.__class__.__name__}", file=sys.stderr)
        return 2
    for line in lines:
        print(line)
    return 1 if "(damaged)" in lines[0] else 0  # the first line marks each damaged step


if __name__ == "__main__":
    sys.exit(main())
