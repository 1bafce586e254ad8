"""The cost model's figures for the run's own layout, beside the compiler's (``--dry-run``).

`cost_model_lines` prices the run's `sharding.parallel.Parallelism` and execution settings with
`sharding.costmodel` (through `sharding.costmodel.layout_of`, the one way from a run's layout to the
cost model's) and prints, per device per step, each figure next to what the compiled step says:
matrix-product FLOPs (loop trips counted, `sharding.hlo.dot_flops`), FLOPs as
``compiled.cost_analysis()`` counts them (each loop body once), the step's argument bytes (state and
batch, ``compiled.memory_analysis()``), its temporaries (`sharding.costmodel.Memory.in_flight` against
``temp_size_in_bytes``) and the bytes of each collective kind
(`sharding.hlo.collectives`). The same comparison `bench/costmodel.py` makes on its grid.
"""

from __future__ import annotations

import math

import jax

from sharding import costmodel as cm
from sharding import hlo
from sharding.costmodel.zero import not_split
from train.setup import strategy_setup
from train.setup.flagnames import render


def _flop(n: float) -> str:
    return f"{n / 1e12:.2f} TFLOP" if n >= 1e11 else f"{n / 1e9:.3f} GFLOP"


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _predicted(trainer, batch: int, seq_len: int, backend: str) -> tuple[cm.Cost, str]:
    """The cost of the run's busiest device and which one it is (`train.setup.strategy_setup.priced`)."""
    par, config = trainer.par, trainer.config
    layout = cm.layout_of(par, config)
    cost, who = strategy_setup.priced(par, config, layout, batch, seq_len, backend)
    if layout.context_shares is not None:  # every device runs the same padded blocks; attention differs
        who = "the ring device with the largest share"
    return cost, who


def cost_model_lines(trainer, compiled, batch: int, seq_len: int) -> list[str]:
    """Lines comparing the cost model's prediction for the run's layout with the compiled step.

    Args:
      trainer: The `train.runtime.step.Trainer` (its `Parallelism` ``par``, bound to the mesh, and model ``config``).
      compiled: Its compiled train step (`Trainer.compile_train_step`).
      batch: Global batch, sequences.
      seq_len: Tokens per sequence.

    Returns:
      The lines; one saying why when the cost model cannot price the layout (e.g. an attention it does
      not model on this mesh), so a dry run never fails on it.
    """
    platform = trainer.mesh.devices.flat[0].platform
    backend = "cpu" if platform == "cpu" else "gpu"
    try:
        cost, who = _predicted(trainer, batch, seq_len, backend)
    except ValueError as e:
        return [f"cost model: this layout is not priced: {render(e)}"]
    text = compiled.as_text()
    analysis = compiled.cost_analysis()
    analysis = analysis[0] if isinstance(analysis, (list, tuple)) else analysis
    memory = compiled.memory_analysis()
    rows = [
        ("matrix-product FLOPs", _flop(cost.matmul_flops), _flop(hlo.dot_flops(text))),
        ("FLOPs as cost_analysis", _flop(cost.counted_flops), _flop(float(analysis.get("flops", 0.0)))),
        (
            "arguments (state + batch)",
            _mib(cost.argument_bytes),
            _mib(memory.argument_size_in_bytes) if memory is not None else "n/a",
        ),
        *_state_rows(trainer, cost),
        ("temporaries", _mib(cost.memory.in_flight), _mib(memory.temp_size_in_bytes) if memory is not None else "n/a"),
    ]
    predicted, actual = cm.collective_bytes(cost.comms), cm.collective_bytes(hlo.collectives(text))
    for kind in sorted(set(predicted) | set(actual)):
        rows.append((kind, _mib(predicted.get(kind, 0.0)), _mib(actual.get(kind, 0.0))))
    lines = [
        f"cost model (sharding.costmodel, {backend} lowering) for this run's layout, {who}, per step:",
        f"  {'':<28} {'predicted':>14} {'compiled':>14}",
    ]
    lines += [f"  {label:<28} {pred:>14} {got:>14}" for label, pred, got in rows]
    if cost.memory.cpu_only:
        lines.append(
            f"  of the predicted temporaries, {_mib(cost.memory.cpu_only)} are XLA:CPU's own (a mixture of experts' "
            f"grouped products lowered densely, float32 copies of bfloat16 activations): on a GPU about "
            f"{_mib(cost.memory.in_flight - cost.memory.cpu_only)}"
        )
    if cost.memory.before_loop:
        lines.append(
            f"  the predicted temporaries are the larger of two phases: {_mib(cost.memory.in_loop)} in the tick loop, "
            f"{_mib(cost.memory.gradients + cost.memory.before_loop)} before it (gathering the working copy)"
        )
    lines += not_split(trainer.config, cm.layout_of(trainer.par, trainer.config))
    return lines + strategy_setup.cost_notes(trainer.par)


def cpu_only_bytes(trainer, batch: int, seq_len: int) -> float:
    """Bytes of the step's temporaries that the cost model prices as XLA:CPU's alone
    (`sharding.costmodel.Memory.cpu_only`); 0 on other platforms or where the layout is not priced."""
    if trainer.mesh.devices.flat[0].platform != "cpu":
        return 0.0
    try:
        cost, _ = _predicted(trainer, batch, seq_len, "cpu")
    except ValueError:
        return 0.0
    return cost.memory.cpu_only


def _state_rows(trainer, cost) -> list[tuple[str, str, str]]:
    """The state's two parts as rows of the cost model's table: the float32 parameters and the optimizer's
    arrays, the cost model's against the blocks of the compiled step's arguments one device holds (as the state's
    shardings lay them out, with ``--optimizer-sharding data`` split over ``data`` too; scalars left out)."""
    state = trainer.state_layout.abstract_state()

    def held(tree) -> float:
        return float(
            sum(math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree) if x.ndim)
        )

    return [
        ("  of which parameters", _mib(cost.memory.parameters), _mib(held(state["params"]))),
        ("  of which optimizer state", _mib(cost.memory.optimizer), _mib(held(state["opt_state"]))),
    ]
