"""List what a checkpoint folder holds: ``python -m checkpoints.inspect DIR [--step N]``.

Prints the saved steps, then for one step (default: the latest) the mesh and
rules it was saved from, the data position, and each array's shape, dtype
and bytes. Reads metadata only: no array is loaded and no device is used.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import numpy as np


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


def describe(directory: str | Path, step: int | None = None) -> list[str]:
    """The report lines for a checkpoint folder.

    Raises:
      FileNotFoundError: when the folder does not exist or holds no checkpoint.
    """
    from checkpoints.manager import CheckpointManager
    from sharding.mesh import format_mesh

    root = _resolve_dir(Path(directory))
    if not root.is_dir():
        raise FileNotFoundError(f"{directory}: no such folder")
    manager = CheckpointManager(root, async_save=False)
    try:
        steps = manager.all_steps()
        if not steps:
            hint = ""
            if root.name.isdigit():
                hint = f"; for one step of a run give the run folder and --step, e.g. {root.parent} --step {root.name}"
            raise FileNotFoundError(f"{root}: no complete checkpoint{hint}")
        step = steps[-1] if step is None else step
        if step not in steps:
            raise FileNotFoundError(f"{root}: no step {step}; saved steps are {steps}")
        meta = manager.read_meta(step)
        rows = array_rows(manager.state_metadata(step))
    finally:
        manager.close()
    lines = [f"checkpoints in {root}: steps {', '.join(map(str, steps))}", f"step {step}:"]
    if "mesh" in meta:
        lines.append(f"  saved on mesh   {format_mesh(meta['mesh'])}")
    if "rules" in meta:
        lines.append(f"  rules           {meta['rules'].get('name')}")
    if meta.get("pipeline"):
        layout = meta["pipeline"]
        lines.append(f"  stage layout    {','.join(map(str, layout.get('stage_layers', [])))} layers per stage "
                     f"({layout.get('schedule')}); layer arrays are [stage, slot, ...], re-laid on resume")
    if "preset" in meta:
        lines.append(f"  model           {meta['preset']} {meta.get('model', {})}")
    if "data" in meta:
        lines.append(f"  data position   {meta['data'].get('samples')} samples of {meta['data'].get('spec')}")
    if "tokenizer" in meta:
        lines.append(f"  tokenizer       {meta['tokenizer'].get('name')} ({meta['tokenizer'].get('vocab_size')} tokens)")
    width = max((len(r[0]) for r in rows), default=10)
    lines.append(f"  {'array'.ljust(width)}  {'shape':<20} {'dtype':<8} bytes")
    for path, shape, dtype, nbytes in rows:
        lines.append(f"  {path.ljust(width)}  {str(shape):<20} {dtype:<8} {nbytes:,}")
    lines.append(f"  total {sum(r[3] for r in rows):,} bytes in {len(rows)} arrays")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m checkpoints.inspect", description=__doc__.splitlines()[0])
    parser.add_argument("directory", help="a run folder or its checkpoints/ folder")
    parser.add_argument("--step", type=int, default=None, help="which step (default: the latest)")
    args = parser.parse_args(argv)
    try:
        for line in describe(args.directory, args.step):
            print(line)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
