"""The distributed optimizer over ``data`` (ZeRO stage 1, `sharding.zero`): the state one device holds, compiled
against the cost model, replicated and split.

For each layout, one train step of ``--model small`` is compiled from abstract shapes on 8 simulated CPU devices
(`bench/costmodel_grid.compiled_figures`) with ``--optimizer-sharding replicated`` and ``data``; the table gives
per device the float32 parameters and the optimizer state (AdamW's two moments) as the compiled step takes
them (its arguments' blocks), the cost model's figures beside them (`bench/costmodel_grid.predicted`,
``backend="cpu"``), and the bytes of each collective kind, compiled and predicted.

Run by hand: ``python bench/zero.py`` (about 3 minutes on 2 CPU cores); prints a Markdown table.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from costmodel_grid import compiled_figures, predicted  # noqa: E402

from sharding import costmodel as cm  # noqa: E402

CASES = [  # (model, mesh, rules, batch, seq_len, microbatches, remat[, stage_layers, repeats])
    ("small", "data=4,tensor=2", "fsdp_tp", 32, 32, 1, "none"),
    ("small", "data=4,stage=2", "fsdp_tp", 32, 32, 4, "none", None, 1),
]


def _mib(n: float) -> str:
    return f"{n / 2**20:.3f}"


def main() -> None:
    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices")
    print()
    print(
        "| mesh | optimizer sharding | parameters MiB (compiled / model) | optimizer MiB (compiled / model) "
        "| collectives MiB per kind (compiled / model) |"
    )
    print("|---|---|---|---|---|")
    for case in CASES:
        for sharding in ("replicated", "data"):
            figures, cost = compiled_figures(case, sharding), predicted(case, sharding)
            state = figures["state_bytes"]
            model = cm.collective_bytes(cost.comms)
            kinds = sorted(set(model) | set(figures["collectives"]))
            comms = ", ".join(
                f"{k} {_mib(figures['collectives'].get(k, 0.0))} / {_mib(model.get(k, 0.0))}" for k in kinds
            )
            print(
                f"| {case[1]} | {sharding} | {_mib(state['params'])} / {_mib(cost.memory.parameters)} "
                f"| {_mib(state['opt_state'])} / {_mib(cost.memory.optimizer)} | {comms} |"
            )


if __name__ == "__main__":
    main()
