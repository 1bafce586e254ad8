"""How a train step computes its gradients: one protocol, three strategies, each owning its specifics.

Every strategy is a `GradientStrategy` (`train.strategies.protocol`): ``gradients(loss_fn, params, batch,
inputs) -> (loss_sum, weight, grads, metrics)``, where ``loss_fn(params, batch, par) -> (loss_sum,
weight_sum)`` is the model's summed token loss under a `sharding.parallel.Parallelism`. The sums are divided
once by the batch's token count in the optimizer update (`train.step.Trainer`), so every strategy gives the
update of the one-shot batch:

=======================  ==================================================================================
`AccumulatedGradients`   the batch in M strided microbatches (row ``r`` in microbatch ``r % M``, so each
                         device's share of a microbatch stays on it), gradients summed over a `jax.lax.scan`
                         (`train.strategies.accumulate`)
`PipelineExecution`      the model runs its layer stack as a pipeline over ``stage`` (`sharding.pipeline`);
                         the pipeline's M microbatches flow inside one forward and backward pass
                         (`train.strategies.pipeline`)
`UnevenGradients`        each data-parallel group (a device along ``data`` x ``fsdp`` with its ``tensor``
                         peers) runs its own number of microbatches, an input of the step (uneven data
                         parallelism for devices of different speeds, `train.strategies.uneven`)
=======================  ==================================================================================

Besides the gradients, a strategy owns what the rest of the run needs of it: its extra step inputs and
their shardings, its checks, its start-up resolution, its flags and its report lines (the protocol lists
them). `kind_of` maps a `Parallelism`'s strategy value to its class, `make_strategy` binds one to the mesh;
they are the only places that ask which strategy a run has. Heterogeneous-cluster helpers (data-parallel
groups, device speeds) live in `train.strategies.hetero`.
"""

from __future__ import annotations

from sharding.parallel import Accumulation, Parallelism, UnevenBatch
from train.strategies.accumulate import AccumulatedGradients
from train.strategies.hetero import batch_grid, batch_groups, device_speeds, group_kinds, slowest_of_groups
from train.strategies.pipeline import PipelineExecution, checked_pipeline
from train.strategies.protocol import GradientStrategy, LossFn, StepInput
from train.strategies.uneven import UnevenGradients, check_uneven, describe_uneven, resolve_uneven, uneven_row_index


def kind_of(strategy) -> type[GradientStrategy]:
    """The `GradientStrategy` class of a `Parallelism`'s strategy value (`Accumulation`,
    `sharding.pipeline.PipelinePlan` or `UnevenBatch`).

    Raises:
      TypeError: Any other value.
    """
    from sharding.pipeline.layout import PipelinePlan

    if isinstance(strategy, PipelinePlan):
        return PipelineExecution
    if isinstance(strategy, UnevenBatch):
        return UnevenGradients
    if isinstance(strategy, Accumulation):
        return AccumulatedGradients
    raise TypeError(f"not a gradient strategy: {strategy!r}")


def make_strategy(par: Parallelism, layout) -> GradientStrategy:
    """The `GradientStrategy` of ``par.strategy``, bound to ``par``'s mesh.

    Args:
      par: The run's layout, bound to a mesh.
      layout: The run's `train.state.StateLayout` (the parameters' names, shapes and shardings).

    Raises:
      ValueError: A strategy that does not fit the mesh or rules (`check_uneven`).
    """
    return kind_of(par.strategy)(par, layout)


__all__ = [
    "AccumulatedGradients",
    "GradientStrategy",
    "LossFn",
    "PipelineExecution",
    "StepInput",
    "UnevenGradients",
    "batch_grid",
    "batch_groups",
    "check_uneven",
    "checked_pipeline",
    "describe_uneven",
    "device_speeds",
    "group_kinds",
    "kind_of",
    "make_strategy",
    "resolve_uneven",
    "slowest_of_groups",
    "uneven_row_index",
]
