"""The one jitted train step.

One step function for every layout: the strategy of the run's `sharding.parallel.Parallelism` computes
the summed loss, token count and gradients (`train.strategies`: accumulation or uneven counts; a pipelined
model runs its microbatches inside one pass), then `Trainer.apply_gradients` divides once by the token count and applies the optimizer update, so the
update equals the one-shot update whatever the strategy. One jit builder (`Trainer._jit`) compiles it with
explicit in/out shardings, donating the state. The state's shapes, storage and shardings are its
`train.runtime.state.StateLayout`'s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.lora import trainable, with_trainable
from models.moe import router_objective
from models.spec import describe
from models.transformer import loss_sums, loss_terms, pipelined_loss_stats
from sharding import axes as ax
from sharding.parallel import Parallelism
from sharding.rules import path_str
from sharding.zero import gather_params
from train import strategies
from train.data import FIELDS, model_inputs
from train.runtime.optimizer import OptimizerConfig, learning_rate_schedule
from train.runtime.state import StateLayout

BATCH_NAMES = (ax.BATCH, ax.LENGTH)

_LAYOUT_ATTRIBUTES = frozenset(
    {
        "graphdef",
        "abstract_params",
        "param_names",
        "layout",
        "storage",
        "tx",
        "update",
        "state_params",
        "param_shardings",
        "report",
        "state_shardings",
        "abstract_state",
        "param_targets",
        "init_state",
        "state_from_params",
        "layout_meta",
        "relayout_state",
        "_layout_state",
        "_init_fn",
    }
)


def max_load(load: jax.Array) -> jax.Array:
    """The routing balance of a step: the largest share of its layer's routed copies any expert received,
    over the mean share (``1 / experts``); 1.0 when every expert of every MoE layer gets as many, ``experts``
    when one gets all.

    Args:
      load: ``[moe_layers, experts]`` float32 copies routed to each expert (`models.moe.router_losses`).

    Returns:
      A float32 scalar, the maximum over layers and experts of ``load / mean(load over experts)``.
    """
    mean = jnp.maximum(jnp.mean(load, axis=-1, keepdims=True), 1e-9)
    return jnp.max(load / mean)


def expert_share(load: jax.Array) -> jax.Array:
    """Each expert's share of the step's routed copies over all MoE layers, over the mean share: ``[experts]``
    float32, mean 1.0 (1.0 each when balanced); the step's metrics carry it as a histogram.

    Args:
      load: ``[moe_layers, experts]`` float32 copies routed to each expert (`models.moe.router_losses`).
    """
    per_expert = jnp.sum(load, axis=0)
    return per_expert / jnp.maximum(jnp.mean(per_expert), 1e-9)


class Trainer:
    """The train step of a model on one mesh: the step, its jit cache and its per-step host inputs.

    Args:
      config: The model.
      optimizer: Optimizer hyperparameters.
      par: The run's `sharding.parallel.Parallelism`, bound to a mesh (`Parallelism.on`); its strategy
        says how gradients are computed.

    Attributes:
      state_layout: The `train.runtime.state.StateLayout` of the state the step updates. Its attributes and methods
        (``abstract_params``, ``storage``, ``state_shardings``, ``init_state``, ``abstract_state``, ...) read
        through the trainer too: ``trainer.init_state`` is ``trainer.state_layout.init_state``.
      strategy: The `train.strategies.GradientStrategy`; its step inputs (`GradientStrategy.step_inputs`)
        are inputs of the step beside ``stop`` (`signals`).
      schedule: The learning rate by update count (`train.runtime.optimizer.learning_rate_schedule`).
      startup_compile_seconds: Seconds the start-up check took to compile this step (None: not compiled
        there); a dry run's compilation then comes from the cache and reports this figure.

    Raises:
      ValueError: A strategy that does not fit the mesh (`train.strategies.make_strategy`), or as
        `train.runtime.state.StateLayout`.
    """

    def __init__(self, config: ModelConfig, optimizer: OptimizerConfig, par: Parallelism):
        self.state_layout = StateLayout(config, par, optimizer)
        self.config, self.optimizer, self.par = config, optimizer, par
        self.mesh, self.rules = par.mesh, par.rules
        self.schedule = learning_rate_schedule(optimizer)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.strategy = strategies.make_strategy(par, self.state_layout)
        self.step_inputs = self.strategy.step_inputs()
        self._jitted: dict[tuple, Any] = {}
        self.startup_compile_seconds: float | None = None

    def __getattr__(self, name: str):
        if name in _LAYOUT_ATTRIBUTES:
            return getattr(self.__dict__["state_layout"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def batch_sharding(self, global_batch: int, seq_len: int) -> NamedSharding:
        """Sharding of one ``[batch, length]`` field of a global batch."""
        return self.par.sharding(BATCH_NAMES, (global_batch, seq_len))

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        """A global batch as `jax.ShapeDtypeStruct`s with their shardings."""
        sharding = self.batch_sharding(global_batch, seq_len)
        return {
            f: jax.ShapeDtypeStruct(
                (global_batch, seq_len), jnp.float32 if f == "loss_mask" else jnp.int32, sharding=sharding
            )
            for f in FIELDS
        }

    # The step ------------------------------------------------------------------------------------

    def loss_sums(self, params, batch, par: Parallelism | None = None) -> tuple[jax.Array, jax.Array]:
        """``(loss_sum, weight_sum)`` of a batch (inside jit) under ``par`` (default the run's)."""
        return loss_sums(
            self.state_layout.graphdef,
            params,
            *model_inputs(batch),
            par=self.par if par is None else par,
        )

    def loss_and_stats(self, params, batch, par: Parallelism | None = None):
        """``(loss_sum, (weight_sum, stats))``: `loss_sums` with a mixture of experts' router statistics,
        ``moe_aux_sum`` and ``moe_z_sum`` (the losses times the tokens, so that microbatches add up) and
        ``moe_dropped`` (routed copies dropped for capacity), float32 scalars, and ``moe_load``
        ``[moe_layers, experts]``, the copies routed to each expert (counts, which microbatches add). Under a
        pipeline, whose stages sum the layers' statistics, ``moe_load_total [experts]`` (summed over the MoE
        layers) in place of ``moe_load``."""
        par = self.par if par is None else par
        if par.pipeline is not None:
            objective, weight, stats = pipelined_loss_stats(
                self.state_layout.graphdef,
                params,
                *model_inputs(batch),
                par=par,
            )
            summed = {
                "moe_aux_sum": stats["aux_sum"],
                "moe_z_sum": stats["z_sum"],
                "moe_dropped": stats["dropped"],
                "moe_load_total": stats["load"],
            }
            return objective, (weight, summed)
        ce, weight, stats = loss_terms(
            self.state_layout.graphdef,
            params,
            *model_inputs(batch),
            par=par,
        )
        objective = ce + router_objective(self.config, stats, weight)
        summed = {
            "moe_aux_sum": stats["aux"] * weight,
            "moe_z_sum": stats["z"] * weight,
            "moe_dropped": stats["dropped"],
            "moe_load": stats["load"],
        }
        return objective, (weight, summed)

    def gradients(self, params, batch, inputs=None) -> tuple[jax.Array, jax.Array, Any, dict]:
        """The strategy's ``(loss_sum, weight_sum, grads, metrics)`` of a global batch (inside jit);
        ``inputs``: values of the strategy's step inputs by name (absent: their defaults). A mixture of experts
        under a strategy that reports statistics adds ``moe_aux``, ``moe_z`` (token means), ``moe_dropped``,
        ``moe_max_load`` (`max_load`; not under a pipeline, whose stages sum the layers' loads) and
        ``moe_expert_share`` (`expert_share`). With adapters (`models.lora`) the gradients are the factors'
        alone (`models.lora.trainable`'s tree): the rest enters the loss as a constant."""
        config = self.config

        def of_trainable(loss_fn):  # the loss as a function of the trained part, the rest held fixed
            return lambda part, b, par=None: loss_fn(with_trainable(config, params, part), b, par)

        part = trainable(config, params)
        if self.config.is_moe and self.strategy.reports_stats:
            loss_sum, weight, grads, metrics = self.strategy.gradients(
                of_trainable(self.loss_and_stats), part, batch, inputs or {}
            )
            metrics = dict(metrics)
            if "moe_load" in metrics:
                load = metrics.pop("moe_load")
                metrics["moe_max_load"] = max_load(load)
            else:
                load = metrics.pop("moe_load_total")[None]
            metrics["moe_expert_share"] = expert_share(load)
            return loss_sum, weight, grads, metrics
        return self.strategy.gradients(of_trainable(self.loss_sums), part, batch, inputs or {})

    def compute_params(self, params):
        """The state's parameters laid out for the forward and backward (inside jit): as they are, or with
        ``optimizer_sharding`` ``data`` gathered over ``data`` from the state's slices (`sharding.zero`); the
        gradients taken with respect to them are laid back out as the slices in `apply_gradients`, which XLA
        turns into a reduce-scatter. With a compute dtype narrower than the parameters (bfloat16) the slices
        are gathered in it and widened back (`sharding.zero.gather_params`): half the gather's bytes, the
        forward seeing each parameter as the compute dtype rounds it."""
        if self.par.optimizer_sharding != ax.DATA:
            return params
        layout = self.state_layout
        return gather_params(
            params, layout.state_shardings["params"], layout.param_shardings, jnp.dtype(self.config.dtype)
        )

    def _looked_up_gradients_whole(self, grads):
        """With ``optimizer_sharding`` ``data``, the gradient of each table the model looks rows up in (role
        ``embedding``, `models.spec`) summed as the rules lay the table out before `apply_gradients` lays it out
        as its master slice (inside jit). Otherwise the partitioner, propagating the slice back into the
        scatter-add that forms the gradient, gathers every token's row of the cotangent and the token ids over
        ``data`` to scatter into its slice: ``[batch, length, embed]`` float32 per device, more bytes than the
        table's gradient once the batch's tokens outnumber the vocabulary. The other gradients are left to the partitioner, which
        reduce-scatters them straight to their slices (over ``fsdp`` and ``data`` at once where both split
        them)."""
        if self.par.optimizer_sharding != ax.DATA:
            return grads
        tables = {p.path for p in describe(self.config).params if p.role == "embedding"}
        shardings = trainable(self.config, self.state_layout.param_shardings)

        def place(path, grad, sharding):
            return jax.lax.with_sharding_constraint(grad, sharding) if path_str(path) in tables else grad

        return jax.tree_util.tree_map_with_path(place, grads, shardings)

    def _step(self, state, batch, signals):
        inputs = {i.name: signals[i.name] for i in self.step_inputs}
        loss_sum, weight, grads, extra = self.gradients(self.compute_params(state["params"]), batch, inputs)
        grads = self._looked_up_gradients_whole(grads)
        new_state, metrics = self.apply_gradients(state, loss_sum, weight, grads, signals["stop"])
        return new_state, {**metrics, **extra}

    def apply_gradients(self, state, loss_sum, weight, grads, signals) -> tuple[dict, dict]:
        """The optimizer update from summed gradients (inside jit); ``(new_state, metrics)``.

        Args:
          state: ``{"step", "params", "opt_state", "rng"}``.
          loss_sum: float32 scalar, the summed token loss (nats).
          weight: float32 scalar, the summed loss mask (tokens).
          grads: Gradients of ``loss_sum``, shaped as the trained parameters (`models.lora.trainable`).
          signals: The ``[num_devices]`` int32 stop-signal vector (`signals`'s ``stop``).

        A non-finite loss or gradient leaves parameters and optimizer state as they were, bit for bit
        (``metrics["finite"]`` is False); the step counter still advances. The update is the state layout's
        `train.runtime.optimizer.GuardedUpdate`: the clipping (a collective) before a `jax.lax.cond`, the optimizer's
        elementwise update inside it, so XLA writes the moments and parameters in place instead of holding
        new ones beside the old (a `jnp.where` of new and old state, or an update computed before the
        conditional, keeps a second copy of the moments through the step's peak).
        """
        denom = jnp.maximum(weight, 1.0)
        # laid out as the parameters before the conditional, so that no resharding collective lands inside it
        grads = jax.lax.with_sharding_constraint(
            jax.tree.map(lambda g: g / denom, grads),
            trainable(self.config, self.state_layout.state_shardings["params"]),
        )
        grad_norm = (
            optax.tree.norm(grads) if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm(grads)
        )
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        part, opt_state = self.state_layout.update(
            grads, state["opt_state"], trainable(self.config, state["params"]), finite
        )
        params = with_trainable(self.config, state["params"], part)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": grad_norm,
            "lr": self.schedule(state["step"]),
            "tokens": weight,
            "finite": finite,
            "stop": jnp.max(signals) > 0,
        }
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": state["rng"]}
        return new_state, metrics

    def signal_sharding(self) -> dict[str, NamedSharding]:
        """Shardings of the step's host inputs (`signals`): ``stop`` one entry per device, then the strategy's
        step inputs (e.g. the uneven ``counts``, replicated)."""
        out = {"stop": NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))}
        out.update((i.name, i.sharding) for i in self.step_inputs)
        return out

    def signals(self, stop: bool, *values) -> dict[str, jax.Array]:
        """The step's per-step host inputs: ``stop``, this process's stop request as the global
        ``[num_devices]`` int32 vector, and the strategy's step inputs (`GradientStrategy.step_inputs`), of
        ``values`` in their order (None or absent: the input's default). The uneven strategy's is ``counts``,
        int32 ``[groups along data x fsdp]`` microbatches per data-parallel group (default the strategy's
        counts; each at most its capacity, summing to the same total: they change without recompiling the step).

        The train step reduces ``stop`` with a max, so every process reads the same ``stop`` metric and all
        stop after the same step. Every process must pass the same values.

        Raises:
          ValueError: A value the input refuses (uneven counts of the wrong length or total, or above the
            buffer's capacity), or more values than inputs.
        """
        if len(values) > len(self.step_inputs):
            raise ValueError(f"{len(values)} step input values for the strategy's {len(self.step_inputs)}")
        value = np.int32(1 if stop else 0)
        stop_sharding = NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))
        out = {
            "stop": jax.make_array_from_callback(
                (self.mesh.devices.size,), stop_sharding, lambda index: np.full((1,), value)
            )
        }
        given = values + (None,) * (len(self.step_inputs) - len(values))
        out.update((i.name, i.array(v)) for i, v in zip(self.step_inputs, given, strict=True))
        return out

    def _jit(self, kind: str, global_batch: int, seq_len: int):
        """The one jit builder: ``train`` ``(state, batch, signals) -> (state, metrics)`` (donating the state;
        ``signals`` as `signals` returns)
        or ``eval`` ``(params, batch) -> (loss_sum, weight_sum)``, with explicit shardings, cached."""
        key = (kind, global_batch, seq_len)
        if key not in self._jitted:
            self.strategy.check_batch(global_batch)
            batch = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}
            if kind == "train":
                state = self.state_layout.state_shardings
                self._jitted[key] = jax.jit(
                    self._step,
                    in_shardings=(state, batch, self.signal_sharding()),
                    out_shardings=(state, self.replicated),
                    donate_argnums=0,
                )
            else:
                self._jitted[key] = jax.jit(
                    lambda params, batch: self.loss_sums(self.compute_params(params), batch),
                    in_shardings=(self.state_layout.state_shardings["params"], batch),
                    out_shardings=(self.replicated, self.replicated),
                )
        return self._jitted[key]

    def train_step(self, global_batch: int, seq_len: int):
        """The jitted step ``(state, batch, signals) -> (state, metrics)``; donates ``state``.

        Metrics are replicated: ``loss`` (nats per token), ``grad_norm`` (before clipping), ``lr`` (of this
        step), ``tokens`` (counted by the loss mask), ``finite`` (bool; when False the update was skipped),
        ``stop`` (bool; some process asked to stop, see `signals`), and the strategy's own (uneven counts:
        ``microbatches``, the total processed, and ``processed``, int32 ``[groups along data x fsdp]``).

        Raises:
          ValueError: A batch the strategy cannot split (uneven counts), naming ``--batch-size``.
        """
        return self._jit("train", global_batch, seq_len)

    def eval_step(self, global_batch: int, seq_len: int):
        """The jitted ``(params, batch) -> (loss_sum, weight_sum)``."""
        return self._jit("eval", global_batch, seq_len)

    def abstract_train_args(self, global_batch: int, seq_len: int) -> tuple[dict, dict, dict]:
        """The train step's arguments ``(state, batch, signals)`` as `jax.ShapeDtypeStruct`s with their
        shardings (no allocation): what `train_step` is lowered with, for this machine's compiler
        (`compile_train_step`) or exported for another platform (``jax.export.export(train_step(...),
        platforms=["cuda"])(*args)``, lowering only)."""
        signals = {
            "stop": jax.ShapeDtypeStruct((self.mesh.devices.size,), jnp.int32, sharding=self.signal_sharding()["stop"])
        }
        signals.update((i.name, i.abstract()) for i in self.step_inputs)
        return self.state_layout.abstract_state(), self.abstract_batch(global_batch, seq_len), signals

    def compile_train_step(self, global_batch: int, seq_len: int):
        """Ahead-of-time compiled train step from abstract shapes (no allocation)."""
        args = self.abstract_train_args(global_batch, seq_len)
        return self.train_step(global_batch, seq_len).lower(*args).compile()


def param_bytes(tree) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in a tree."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
