"""How a train step computes its gradients: one protocol, two strategies, each owning its step's specifics.

Every strategy is a `GradientStrategy` (`train.strategies.protocol`): ``gradients(loss_fn, params, batch,
inputs) -> (loss_sum, weight, grads, metrics)``, where ``loss_fn(params, batch, par) -> (loss_sum,
weight_sum)`` is the model's summed token loss under a `sharding.parallel.Parallelism`. The sums are divided
once by the batch's token count in the optimizer update (`train.runtime.step.Trainer`), so every strategy gives the
update of the one-shot batch:

=======================  ==================================================================================
`AccumulatedGradients`   the batch in M strided microbatches (row ``r`` in microbatch ``r % M``, so each
                         device's share of a microbatch stays on it), gradients summed over a `jax.lax.scan`
                         (`train.strategies.accumulate`); with M = 1, one forward and backward pass
`UnevenGradients`        each data-parallel group (a device along ``data`` x ``fsdp`` with its ``tensor``
                         peers) runs its own number of microbatches, an input of the step (uneven data
                         parallelism for devices of different speeds, `train.strategies.uneven`)
=======================  ==================================================================================

A pipeline is not a strategy: it is the model's execution mode over ``stage`` (a
`sharding.pipeline.PipelinePlan` in the layout), whose M microbatches flow inside the model's one forward
and backward pass (`models.transformer`); its gradients are the plain pass's (`AccumulatedGradients` with
M = 1). Besides the gradients, a strategy owns its extra step inputs and their shardings, its check of the
batch before compiling and its controller of the inputs between steps (the protocol lists them); what
start-up reads of the layout is `train.setup.strategy_setup`'s. `make_strategy` is the one place that picks a class.
Heterogeneous-cluster helpers (data-parallel groups, device speeds) live in `train.strategies.hetero`.
"""

from __future__ import annotations

from sharding.parallel import Parallelism, UnevenBatch
from train.strategies.accumulate import AccumulatedGradients
from train.strategies.hetero import (
    batch_grid,
    batch_groups,
    compute_pools,
    device_speeds,
    group_kinds,
    slowest_of_groups,
)
from train.strategies.protocol import GradientStrategy, LossFn, StepInput
from train.strategies.uneven import UnevenGradients, check_uneven, describe_uneven, resolve_uneven, uneven_row_index


def make_strategy(par: Parallelism, layout) -> GradientStrategy:
    """The `GradientStrategy` of ``par.strategy``, bound to ``par``'s mesh: `UnevenGradients` for an
    `UnevenBatch`, else `AccumulatedGradients` (an `Accumulation`, or a pipeline's one pass).

    Args:
      par: The run's layout, bound to a mesh.
      layout: The run's `train.runtime.state.StateLayout` (the parameters' names, shapes and shardings).

    Raises:
      ValueError: A strategy that does not fit the mesh or rules (`check_uneven`).
    """
    if isinstance(par.strategy, UnevenBatch):
        return UnevenGradients(par, layout)
    return AccumulatedGradients(par, layout)


__all__ = [
    "AccumulatedGradients",
    "GradientStrategy",
    "LossFn",
    "StepInput",
    "UnevenGradients",
    "batch_grid",
    "batch_groups",
    "check_uneven",
    "compute_pools",
    "describe_uneven",
    "device_speeds",
    "group_kinds",
    "make_strategy",
    "resolve_uneven",
    "slowest_of_groups",
    "uneven_row_index",
]
