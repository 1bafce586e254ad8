"""A layout as the command line's flags: the encoder of a `sharding.parallel.Parallelism`.

The library describes a layout by its fields (mesh shape, rules, strategy value, context layout); the
command line speaks flags. `parallelism_flags` renders a layout as the ``python -m train.train`` flags
that reproduce it (`train.setup.cli.parse` reads them back to an equal layout); each strategy renders its own
part (`train.setup.strategy_setup.flags_before_microbatches`, `train.setup.strategy_setup.flags_after_microbatches`). ``--plan auto`` prints it for the layout it chose.
"""

from __future__ import annotations

from sharding import axes as ax
from sharding.mesh import format_mesh
from sharding.parallel import CONTIGUOUS, REPLICATED, Parallelism
from sharding.rules import DEFAULT_PRESET, PRESETS, Rules
from train.setup import strategy_setup


def parallelism_flags(par: Parallelism) -> list[str]:
    """The ``python -m train.train`` flags that reproduce ``par`` (mesh, rules, strategy, context layout).

    Args:
      par: A layout, bound to a mesh or not.

    Returns:
      The flags and their values as separate items, e.g. ``["--mesh", "fsdp=8", "--rules", "fsdp",
      "--microbatches", "1"]``; ``--microbatches`` with given uneven counts is their average per
      data-parallel group, for information.
    """
    mesh = format_mesh(par.mesh_shape) if par.num_devices > 1 else "data=1"
    out = ["--mesh", mesh]
    base, overrides = rules_flags(par.rules, par.pipeline is not None)
    out += ["--rules", base] + [item for rule in overrides for item in ("--rule", rule)]
    if par.outer:
        outer = format_mesh(par.outer)
        if outer != "single device":
            out += ["--mesh-outer", outer]
    out += strategy_setup.flags_before_microbatches(par)
    out += ["--microbatches", str(par.microbatches)]
    out += strategy_setup.flags_after_microbatches(par)
    if par.context_layout != CONTIGUOUS:
        out += ["--context-layout", par.context_layout]
    if par.context_shares is not None:
        shares = par.context_shares
        out += ["--context-shares", shares if isinstance(shares, str) else ",".join(map(str, shares))]
    if par.optimizer_sharding != REPLICATED:
        out += ["--optimizer-sharding", par.optimizer_sharding]
    return out


def rules_flags(rules: Rules, pipeline: bool) -> tuple[str, list[str]]:
    """``(preset, overrides)`` that rebuild ``rules`` as ``--rules PRESET --rule LOGICAL=AXES ...`` (the
    pipeline's own ``layers -> stage`` left out: the pipeline flags add it)."""
    base = rules.name.split("+", 1)[0]
    if base not in PRESETS:
        base = DEFAULT_PRESET
    preset = dict(PRESETS[base])
    overrides = []
    table = dict(rules.table)
    for logical in dict.fromkeys([*preset, *table]):
        mesh_axes = tuple(table.get(logical, ()))
        if pipeline and logical == ax.LAYERS and mesh_axes == (ax.STAGE,):
            continue
        if mesh_axes != tuple(preset.get(logical, ())):
            overrides.append(f"{logical}={'+'.join(mesh_axes) or 'none'}")
    return base, overrides


__all__ = ["parallelism_flags", "rules_flags"]
