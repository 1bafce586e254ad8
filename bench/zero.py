"""The distributed optimizer over ``data`` (ZeRO stage 1, `sharding.zero`): the state one device holds, compiled
against the cost model, replicated and split.

For each layout, one train step of ``--model small`` is compiled from abstract shapes on 8 simulated CPU devices
(`bench/costmodel_grid.compiled_figures`) with ``--optimizer-sharding replicated`` and ``data``; the table gives
per device the float32 parameters and the optimizer state (AdamW's two moments) as the compiled step takes
them (its arguments' blocks), the cost model's figures beside them (`bench/costmodel_grid.predicted`,
``backend="cpu"``), and the bytes of each collective kind, compiled and predicted.

Run by hand: ``python bench/zero.py`` (about 3 minutes on 2 CPU cores); prints a Markdown table.

``python bench/zero.py gathers``: the gathers of the parameters over ``data`` with bfloat16 compute, before
(the float32 master slices gathered as they are, as the step did first) and after (`sharding.zero.gather_params`:
rounded to bfloat16 first), read from the partitioned step before XLA:CPU's float normalisation upcasts
bfloat16 collectives (`sharding.hlo.text_before_pass`), beside the cost model's GPU price of them.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
from costmodel_grid import compiled_figures, config_of, predicted  # noqa: E402

from sharding import costmodel as cm  # noqa: E402
from sharding import hlo  # noqa: E402
from sharding.mesh import make_mesh, parse_mesh  # noqa: E402
from sharding.parallel import Accumulation, Parallelism  # noqa: E402
from sharding.rules import get_rules  # noqa: E402
from train.runtime.optimizer import OptimizerConfig  # noqa: E402
from train.runtime.step import Trainer  # noqa: E402

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


GATHER_CASES = [("small+dtype=bfloat16", "data=4,tensor=2", 32, 32), ("small+dtype=bfloat16", "data=8", 32, 32)]


def gathers() -> None:
    """The table of the parameters' gathers over ``data`` with bfloat16 compute, before and after."""
    print(f"jax {jax.__version__}, {jax.device_count()} simulated CPU devices")
    print()
    print("| model | mesh | gather | all-gathers (dtypes) | MiB per device per step (partitioned) | GPU price MiB |")
    print("|---|---|---|---|---|---|")
    for model, mesh_spec, batch, seq in GATHER_CASES:
        config = config_of(model, "none")
        par = Parallelism.of(make_mesh(parse_mesh(mesh_spec, 8)), get_rules("fsdp_tp"), Accumulation(1))
        trainer = Trainer(config, OptimizerConfig(), par.replace(optimizer_sharding="data"))
        priced = cm.estimate(config, batch, seq, cm.layout_of(trainer.par, config), backend="gpu")
        gpu = sum(c.total_bytes for c in priced.comms if c.kind == "all-gather" and "distributed optimizer" in c.what)
        whole = trainer.state_layout.param_shardings
        for label in ("float32 (before)", "bfloat16 (after)"):
            if label.startswith("float32"):  # the step as it was: the float32 slices constrained to the rules' layout
                trainer.compute_params = lambda p, whole=whole: jax.lax.with_sharding_constraint(p, whole)
            else:
                del trainer.compute_params
            trainer._jitted.clear()
            lowered = trainer.train_step(batch, seq).lower(*trainer.abstract_train_args(batch, seq))
            found = [c for c in hlo.collectives(hlo.text_before_pass(lowered)) if c.op == "all-gather"]
            dtypes = ", ".join(f"{sum(c.dtype == d for c in found)} {d}" for d in sorted({c.dtype for c in found}))
            price = _mib(gpu) if label.startswith("bfloat16") else _mib(gpu * 2)
            print(
                f"| {model} | {mesh_spec} | {label} | {len(found)} ({dtypes}) "
                f"| {_mib(sum(c.total_bytes for c in found))} | {price} |"
            )


if __name__ == "__main__":
    gathers() if sys.argv[1:] == ["gathers"] else main()
