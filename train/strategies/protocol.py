"""The protocol of a gradient strategy: what the jitted step and the training loop ask of one.

A strategy is two things: a value in the run's `sharding.parallel.Parallelism` (`Accumulation` or
`UnevenBatch`: what the command line and the planner build) and the `GradientStrategy` subclass that
implements it here, bound to the mesh (`train.strategies.make_strategy`). The subclass computes the step's
gradients, owns the step's extra inputs and their shardings, and may control those inputs between steps.
What start-up reads of the value before the step exists (checks, flags, cost terms, report lines, the
check of the compiled step) is `train.setup.strategy_setup`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from sharding.parallel import Parallelism

LossFn = Callable[[Any, dict, Parallelism], tuple[jax.Array, jax.Array]]
"""``loss_fn(params, batch, par) -> (loss_sum, weight_sum)``: float32 scalars (nats, tokens)."""


@dataclasses.dataclass(frozen=True)
class StepInput:
    """One per-step host input of the train step besides the state and the batch (e.g. the uneven counts).

    Its value is an input of the compiled step, so it may change between steps without recompiling.

    Attributes:
      name: The key in the step's ``signals`` dict.
      shape: Its shape (int32).
      sharding: Its `jax.sharding.NamedSharding` on the run's mesh.
      default: The value a step gets when the host gives none, int32 ``shape``.
      check: Raises ValueError for a value the step cannot take (e.g. counts above their capacity).
    """

    name: str
    shape: tuple[int, ...]
    sharding: NamedSharding
    default: np.ndarray
    check: Callable[[np.ndarray], None] = lambda value: None

    def array(self, value=None) -> jax.Array:
        """``value`` (default `default`) as the global int32 array the step takes, after `check`.

        Raises:
          ValueError: As `check`.
        """
        value = np.asarray(self.default if value is None else value, np.int32)
        self.check(value)
        return jax.make_array_from_callback(value.shape, self.sharding, lambda index: value[index])

    def abstract(self) -> jax.ShapeDtypeStruct:
        """The input as a `jax.ShapeDtypeStruct` carrying its sharding (ahead-of-time compilation)."""
        return jax.ShapeDtypeStruct(self.shape, np.int32, sharding=self.sharding)


class GradientStrategy:
    """Computes the summed loss, token count and gradients of one global batch (inside jit), and says what
    else the run needs for it. Subclasses override what applies to them; the defaults do nothing.

    Args:
      par: The run's `Parallelism`, bound to a mesh.
      layout: The run's `train.runtime.state.StateLayout` (the parameters' names, shapes and shardings), or None.
    """

    reports_stats = False
    """Whether `gradients` takes a ``loss_fn`` whose auxiliary output is ``(weight_sum, stats)``: ``stats`` a
    dict of float32 scalars summed over microbatches (a mixture of experts' router losses weighted by
    tokens, and dropped copies), returned among the metrics divided as `stats_metrics` says."""

    def __init__(self, par: Parallelism, layout=None):
        self.par = par
        self.layout = layout

    def gradients(self, loss_fn: LossFn, params, batch: dict, inputs: Mapping[str, jax.Array]):
        """``(loss_sum, weight_sum, grads, metrics)``: float32 scalars, gradient sums shaped as ``params``,
        and extra metrics of the strategy (e.g. microbatches processed per device).

        Args:
          loss_fn: The model's summed loss.
          params: The parameters as the state stores them.
          batch: The global batch, ``[batch, length]`` fields.
          inputs: The step's values of `step_inputs`, by name.
        """
        raise NotImplementedError

    @staticmethod
    def stats_metrics(stats: Mapping[str, jax.Array], weight: jax.Array) -> dict[str, jax.Array]:
        """Summed ``stats`` as metrics: those named ``*_sum`` divided by the tokens (``weight``) and renamed
        without the suffix, the others as they are."""
        denom = jnp.maximum(weight, 1.0)
        return {
            (k[: -len("_sum")] if k.endswith("_sum") else k): (v / denom if k.endswith("_sum") else v)
            for k, v in stats.items()
        }

    def step_inputs(self) -> tuple[StepInput, ...]:
        """The strategy's extra per-step host inputs, in the order `train.runtime.step.Trainer.signals` takes their
        values (none by default)."""
        return ()

    def check_batch(self, global_batch: int) -> None:
        """Raises ValueError for a global batch this strategy cannot split, naming the flag (before compiling)."""

    def controller(self):
        """The host-side controller of the step inputs between steps, or None.

        A controller has ``inputs`` (the values of `step_inputs` the next step runs, or None for the
        defaults) and ``observe(step, values, log)``, called with each step's metrics on the host (read one
        step late), which may change ``inputs`` and add metrics to ``values``.
        """
        return None
