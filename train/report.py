"""Human-readable reports: the start-up summary and the ``--dry-run`` analysis."""

from __future__ import annotations

import math

import jax
import numpy as np

from sharding import hlo
from sharding.mesh import crossing_axes, format_mesh


def human_bytes(n: float) -> str:
    """``1536`` -> ``'1.50 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"


def human_count(n: float) -> str:
    """``6738415616`` -> ``'6.74B'``."""
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def startup_lines(config, preset: str, mesh, rules, report, num_params_built: int) -> list[str]:
    """The summary printed before training or a dry run."""
    lines = [
        f"model {preset}: {num_params_built:,} parameters ({human_count(num_params_built)}; "
        f"formula {config.num_params:,}), dtype {config.dtype}, remat {config.remat}, attention {config.attention}",
        f"mesh {format_mesh(dict(mesh.shape))} over {mesh.devices.size} {jax.devices()[0].platform} devices"
        f" in {jax.process_count()} process(es)",
        f"rules {rules.name}: " + ", ".join(f"{k}->{'+'.join(v) or 'none'}" for k, v in rules.table),
    ]
    crossing = crossing_axes(mesh)
    if crossing:
        lines.append("axes crossing processes: " + ", ".join(f"{a} (over {n})" for a, n in crossing.items()))
    lines.append(report.format_replicated())
    return lines


def parameter_table(report, mesh) -> list[str]:
    """Per parameter: shape, logical names, partition spec, per-device shard shape."""
    rows = [("parameter", "shape", "logical axes", "sharding", "per device")]
    for path, shape, _, names, spec, _ in report.rows:
        local = list(shape)
        for dim, entry in enumerate(spec):
            for axis in (entry,) if isinstance(entry, str) else (entry or ()):
                local[dim] //= mesh.shape[axis]
        rows.append((path, str(tuple(shape)), ",".join(n or "-" for n in names), str(tuple(spec)), str(tuple(local))))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]


def memory_lines(compiled, state_bytes: int, num_devices: int) -> list[str]:
    """Per-device bytes from ``compiled.memory_analysis()``."""
    stats = compiled.memory_analysis()
    if stats is None:
        return ["memory analysis: not available on this backend"]
    fields = (
        ("arguments (state + batch)", "argument_size_in_bytes"),
        ("outputs", "output_size_in_bytes"),
        ("aliased (donated state)", "alias_size_in_bytes"),
        ("temporaries", "temp_size_in_bytes"),
        ("generated code", "generated_code_size_in_bytes"),
    )
    lines = ["per-device memory (compiled.memory_analysis()):"]
    for label, attr in fields:
        lines.append(f"  {label:<28} {human_bytes(getattr(stats, attr, 0) or 0)}")
    peak = stats.argument_size_in_bytes + stats.output_size_in_bytes - stats.alias_size_in_bytes + stats.temp_size_in_bytes
    lines.append(f"  {'peak estimate':<28} {human_bytes(peak)}")
    lines.append(
        f"  state (params + optimizer) in all: {human_bytes(state_bytes)}; /{num_devices} devices = "
        f"{human_bytes(state_bytes / num_devices)}"
    )
    return lines


def collective_lines(compiled) -> list[str]:
    """Collectives of the compiled step: count and bytes per step, per device."""
    found = hlo.collectives(compiled.as_text())
    if not found:
        return ["collectives in the compiled step: none"]
    lines = ["collectives in the compiled step (per device, loop trips counted):"]
    for op, (count, nbytes) in hlo.summarize(found).items():
        lines.append(f"  {op:<20} {count:>6} per step  {human_bytes(nbytes):>12} per step")
    return lines


def state_bytes(abstract_state) -> int:
    return int(sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(abstract_state)))
