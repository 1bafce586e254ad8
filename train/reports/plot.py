"""The planner's bar charts (``train.plan --plot``): predicted step time and per-device memory per plan, with
matplotlib (the ``plot`` extra) on its Agg backend."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from sharding import planner
from sharding.mesh import format_mesh
from train.setup.folders import check_writable


def pyplot_for(path: str):
    """``matplotlib.pyplot`` on the Agg backend, once ``path``'s folder is known to exist.

    Called before planning too, so a plot that cannot be written is refused before the search runs.

    Raises:
      RuntimeError: matplotlib is not installed (naming the install command).
      ValueError: the folder of ``path`` does not exist or cannot be written, ``path`` is a folder, or its
        suffix names a format matplotlib does not write; naming ``--plot``.
    """
    folder = Path(path).resolve().parent
    if not folder.is_dir():
        raise ValueError(f"--plot {path}: no folder {folder}; create it or give a path in an existing folder")
    if Path(path).is_dir():
        raise ValueError(f"--plot {path}: a folder; give a file name in it, e.g. --plot {Path(path) / 'plan.png'}")

    check_writable(folder, "--plot")  # a folder without permission fails here, not after the search
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--plot needs matplotlib: pip install 'meshwork[plot]' (or pip install matplotlib)"
        ) from None
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(path).suffix.lower().lstrip(".")
    if suffix and suffix not in FigureCanvasBase.get_supported_filetypes():  # no suffix: matplotlib writes a .png
        raise ValueError(
            f"--plot {path}: matplotlib does not write .{suffix} files; e.g. --plot {Path(path).with_suffix('.png')}"
        )
    return plt


def plot(plans: Sequence[planner.Plan], path: str, title: str) -> None:
    """Bar charts of predicted step time and per-device memory (per kind, against its limit).

    Raises:
      RuntimeError: When matplotlib is not installed (naming the install command).
    """
    plt = pyplot_for(path)
    labels = [
        f"{i}. {format_mesh(p.layout.mesh)}\n{p.layout.rules_name}, M={p.layout.microbatches}, {p.layout.remat}"
        + ("\nuneven" if p.counts else f"\nstages {','.join(map(str, p.stage_layers))}" if p.stage_layers else "")
        for i, p in enumerate(plans, 1)
    ]
    kinds = list(dict.fromkeys(k for p in plans for k in p.memory))
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 1.6 * len(plans)), 8), sharex=True)
    x = range(len(plans))
    top.bar(x, [p.step_time for p in plans], color=["tab:green"] + ["tab:blue"] * (len(plans) - 1))
    top.set_ylabel("predicted step time (s)")
    top.set_title(title)
    width = 0.8 / max(len(kinds), 1)
    for j, kind in enumerate(kinds):
        offsets = [i - 0.4 + width * (j + 0.5) for i in x]
        bottom.bar(offsets, [p.memory.get(kind, 0) / 1e9 for p in plans], width, label=f"{kind} (per device)")
        limit = next(p.memory_limit[kind] for p in plans if kind in p.memory_limit)
        bottom.axhline(limit / 1e9, linestyle="--", linewidth=1, color=f"C{j}", label=f"{kind} usable memory")
    bottom.set_ylabel("predicted memory per device (GB)")
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, fontsize=7)
    bottom.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
