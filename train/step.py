"""The train state, its shardings, and the one jitted train step.

The train state is a dict::

    {"step": int32 [], "params": {...}, "opt_state": optax state, "rng": uint32 [2]}

Parameters are sharded by the logical rules (`sharding.rules.tree_shardings`), the optimizer state like
the parameters it belongs to (`optax.tree_map_params`), scalars replicated. The state is created by one
jitted init with ``out_shardings``, so it is never whole on one device.

One step function for every layout: the strategy of the run's `sharding.parallel.Parallelism` computes
the summed loss, token count and gradients (`train.strategies`: accumulation, pipeline or uneven counts),
then `Trainer.apply_gradients` divides once by the token count and applies the optimizer update, so the
update equals the one-shot update whatever the strategy. One jit builder (`Trainer._jit`) compiles it with
explicit in/out shardings, donating the state.

With a pipeline the stacked layer parameters (and their optimizer state) live unpadded as ``[rows, ...]``
(`sharding.pipeline.storage.StageStorage`): rows split evenly over ``stage`` and the batch axes the rules
shard layer parameters over, so a stage with fewer layers holds no padding; the stage program gathers its
own layers once per step. Checkpoints store the state as it is laid out, with the layout in their
metadata; `relayout_state` re-lays the stacked layer axis on device when a checkpoint's layout differs
(`checkpoints.manager.restore_state`: another storage, the canonical stack, or the padded ``[stage, slot,
...]`` layout of checkpoints saved before), so a run resumes across stage layouts.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.transformer import abstract_model, init_params, loss_sums
from sharding import axes as ax
from sharding.parallel import Parallelism, UnevenBatch
from sharding.pipeline import StageLayout, relayout_on_mesh
from sharding.pipeline.storage import (StageStorage, spread_over_stage, stack_table, storage_axes, storage_for,
                                      storage_spec)
from sharding.rules import tree_shardings
from train import strategies
from train.data import FIELDS
from train.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer

BATCH_NAMES = (ax.BATCH, ax.LENGTH)


class Trainer:
    """Everything needed to build, shard and step a model on one mesh.

    Args:
      config: The model.
      optimizer: Optimizer hyperparameters.
      par: The run's `sharding.parallel.Parallelism`, bound to a mesh (`Parallelism.on`); its strategy
        says how gradients are computed.

    Attributes:
      abstract_params, param_names: The model's parameters (canonical ``[layers, ...]`` stacks) and their
        logical names.
      layout: The run's `StageLayout` (which layers each stage computes), or None (no pipeline).
      storage: How the state stores the layer stacks: the `StageStorage` of ``layout`` on this mesh
        (unpadded rows), or None (canonical ``[layers, ...]``, no pipeline).
      state_params, param_shardings, report, state_shardings: The parameters as the state holds them (in
        ``storage``), their shardings, the `ShardingReport`, and the whole state's shardings.
      strategy: The `train.strategies.GradientStrategy`.

    Raises:
      ValueError: A strategy that does not fit the mesh (`train.strategies.check_uneven`), or a pipeline
        whose stage count is not the mesh's.
    """

    def __init__(self, config: ModelConfig, optimizer: OptimizerConfig, par: Parallelism):
        if par.mesh is None:
            raise ValueError("Trainer needs a Parallelism bound to a mesh (Parallelism.on(mesh))")
        self.config, self.optimizer, self.par = config, optimizer, par
        self.mesh, self.rules = par.mesh, par.rules
        self.graphdef, self.abstract_params, self.param_names = abstract_model(config)
        self.layout = par.pipeline.layout if par.pipeline is not None else None
        if self.layout is not None and self.layout.stages != par.mesh_shape[ax.STAGE]:
            raise ValueError(f"the pipeline has {self.layout.stages} stages but the mesh's stage axis is "
                             f"{par.mesh_shape[ax.STAGE]}; pass --mesh stage={self.layout.stages},...")
        if isinstance(par.strategy, UnevenBatch):
            strategies.check_uneven(par, self.param_names, self.abstract_params)
        self.storage = None if self.layout is None else storage_for(
            self.layout, jax.tree.leaves(self.param_names["layers"], is_leaf=lambda x: isinstance(x, tuple)),
            self.rules, par.mesh_shape)
        self.tx = make_optimizer(optimizer, self.param_names)
        self.schedule = learning_rate_schedule(optimizer)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.state_params, self.param_shardings, self.report, self.state_shardings = self._layout_state(self.storage)
        specs = jax.tree.map(lambda s: s.spec, self.param_shardings)
        self.strategy = strategies.make_strategy(par, specs)
        self._jitted: dict[tuple, Any] = {}

    # Shapes and shardings ------------------------------------------------------------------------

    def _layout_state(self, layout: StageLayout | StageStorage | None):
        """``(params, param_shardings, report, state_shardings)`` with the layer stacks in ``layout``."""
        is_layer = {key: jax.tree.map(lambda _: key == "layers", value) for key, value in self.abstract_params.items()}

        def shape(x, layer):
            return jax.ShapeDtypeStruct(layout.stacked_shape(x.shape), x.dtype) if layer and layout is not None else x

        def names(n, layer):
            return StageLayout.stacked_names(n) if layer and isinstance(layout, StageLayout) else n

        params = jax.tree.map(shape, self.abstract_params, is_layer)
        param_names = jax.tree.map(names, self.param_names, is_layer, is_leaf=lambda x: isinstance(x, tuple))
        param_shardings, report = tree_shardings(params, param_names, self.mesh, self.rules)
        if isinstance(layout, StageStorage) or self.storage is not None:
            param_shardings, report = self._storage_shardings(layout, param_shardings, report)
        opt_shardings = optax.tree_map_params(self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, params),
                                              param_shardings, transform_non_params=lambda _: self.replicated)
        state_shardings = {"step": self.replicated, "params": param_shardings, "opt_state": opt_shardings,
                           "rng": self.replicated}
        return params, param_shardings, report, state_shardings

    def _storage_shardings(self, layout, shardings, report):
        """Shardings (and report rows) re-made for a pipelined run or a `StageStorage` ``layout``: the layer
        stacks' rows (in a `StageStorage`) over ``stage`` and the storage axes, their other dimensions
        without them (`sharding.pipeline.storage.storage_spec`); in a pipelined run, the other parameters
        also split over ``stage`` where a dimension allows, whatever ``layout`` (`spread_over_stage`: every
        stage uses them whole, so GSPMD gathers them once per step, in the same all-gather as over ``fsdp``)."""
        names = jax.tree.leaves(self.param_names["layers"], is_leaf=lambda x: isinstance(x, tuple))
        axes = storage_axes(names, self.rules, self.par.mesh_shape)
        shape = self.par.mesh_shape

        def spec(row):
            if row[0].startswith("layers/"):
                return storage_spec(row[4], layout.rows, shape, axes) if isinstance(layout, StageStorage) else row[4]
            return spread_over_stage(row[4], row[1], shape) if self.storage is not None else row[4]

        specs = [spec(row) for row in report.rows]
        report.rows = [(*row[:4], spec, row[5]) for row, spec in zip(report.rows, specs)]
        treedef = jax.tree.structure(shardings)
        return treedef.unflatten([NamedSharding(self.mesh, spec) for spec in specs]), report

    def abstract_state(self, layout: StageLayout | StageStorage | None | str = "run") -> dict:
        """The state as `jax.ShapeDtypeStruct`s carrying their shardings (restore targets).

        Args:
          layout: The layout of the layer stacks: this run's (default), or another (None: canonical),
            e.g. a checkpoint's before re-laying; its stage dimension is split over this mesh's ``stage``
            axis where it divides, else left whole along it.
        """
        if layout == "run" or layout == self.storage:
            shardings, layout = self.state_shardings, self.storage
        else:
            shardings = self._layout_state(layout)[3]
        shapes = jax.eval_shape(lambda seed: self._init_fn(seed, layout), jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def batch_sharding(self, global_batch: int, seq_len: int) -> NamedSharding:
        """Sharding of one ``[batch, length]`` field of a global batch."""
        return self.par.sharding(BATCH_NAMES, (global_batch, seq_len))

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        """A global batch as `jax.ShapeDtypeStruct`s with their shardings."""
        sharding = self.batch_sharding(global_batch, seq_len)
        return {f: jax.ShapeDtypeStruct((global_batch, seq_len), jnp.float32 if f == "loss_mask" else jnp.int32,
                                        sharding=sharding) for f in FIELDS}

    # Init and layouts ----------------------------------------------------------------------------

    def _init_fn(self, seed, layout: StageLayout | StageStorage | None | str = "run"):
        key = jax.random.key(seed)
        layout = self.storage if layout == "run" else layout
        table = None if layout is None else stack_table(layout, self.config.num_layers)
        params = init_params(self.config, jax.random.fold_in(key, 0), table)
        return self._fresh(params, key)

    def _fresh(self, params, key) -> dict:
        """Step 0 of ``params``: a fresh optimizer state and the run's RNG (of ``key``)."""
        return {"step": jnp.zeros((), jnp.int32), "params": params, "opt_state": self.tx.init(params),
                "rng": jax.random.key_data(jax.random.fold_in(key, 1))}

    def init_state(self, seed: int) -> dict:
        """Fresh state, created sharded by a jitted init with ``out_shardings``.

        With a pipeline, each device builds only its own rows; the values are those of the canonical model
        for the same seed, whatever the layout.
        """
        return jax.jit(self._init_fn, out_shardings=self.state_shardings)(jnp.asarray(seed, jnp.int32))

    def state_from_params(self, params: dict, seed: int) -> dict:
        """Step 0 of given parameters (e.g. imported): a fresh optimizer state, the RNG of ``seed``, in this run's layout.

        Args:
          params: Canonical ``[layers, ...]`` stacks, float32, on this mesh (``abstract_state(None)``'s shardings);
            donated.
          seed: As `init_state`'s.

        Returns:
          The state, laid out for this run (`relayout_state` from the canonical layout for a pipeline).
        """
        canonical = self.state_shardings if self.storage is None else self._layout_state(None)[3]
        fn = jax.jit(lambda p, s: self._fresh(p, jax.random.key(s)), out_shardings=canonical, donate_argnums=0)
        return self.relayout_state(fn(params, jnp.asarray(seed, jnp.int32)), None)

    def layout_meta(self) -> dict | None:
        """This run's storage for checkpoint metadata (None: canonical ``[layers, ...]`` stacks)."""
        return None if self.storage is None else self.storage.to_meta()

    def relayout_state(self, state: dict, src: StageLayout | StageStorage | None) -> dict:
        """Re-lays the layer stacks of ``state`` (params and optimizer state) from ``src`` to this run's storage.

        Only the stacked layer arrays move, on device under `jax.jit` with this run's shardings as
        ``out_shardings``, each device receiving the rows of its stage; no array is gathered on one device.
        """
        if src == self.storage:
            return state
        is_layer = {key: jax.tree.map(lambda _: key == "layers", value) for key, value in self.abstract_params.items()}
        opt = optax.tree_map_params(self.tx, lambda _, layer: layer, state["opt_state"], is_layer,
                                    transform_non_params=lambda _: False)
        leaves, treedef = jax.tree.flatten(state)
        moving = treedef.flatten_up_to({"step": False, "params": is_layer, "opt_state": opt, "rng": False})
        targets = jax.tree.leaves(self.state_shardings)
        picked = [i for i, layer in enumerate(moving) if layer]
        fn = jax.jit(lambda xs: relayout_on_mesh(xs, src, self.storage, self.config.num_layers, self.mesh),
                     out_shardings=[targets[i] for i in picked])
        for i, moved in zip(picked, fn([leaves[i] for i in picked]), strict=True):
            leaves[i] = moved
        return treedef.unflatten(leaves)

    # The step ------------------------------------------------------------------------------------

    def loss_sums(self, params, batch, par: Parallelism | None = None) -> tuple[jax.Array, jax.Array]:
        """``(loss_sum, weight_sum)`` of a batch (inside jit) under ``par`` (default the run's)."""
        return loss_sums(self.graphdef, params, batch["tokens"], batch["targets"], batch["loss_mask"],
                         batch["positions"], batch["segment_ids"], par=self.par if par is None else par)

    def gradients(self, params, batch, counts=None) -> tuple[jax.Array, jax.Array, Any, dict]:
        """The strategy's ``(loss_sum, weight_sum, grads, metrics)`` of a global batch (inside jit);
        ``counts``: the uneven strategy's int32 ``[groups]`` microbatches per data-parallel group (None: its
        own)."""
        if counts is None:
            return self.strategy.gradients(self.loss_sums, params, batch)
        return self.strategy.gradients(self.loss_sums, params, batch, counts)

    def _step(self, state, batch, signals):
        loss_sum, weight, grads, extra = self.gradients(state["params"], batch, signals.get("counts"))
        new_state, metrics = self.apply_gradients(state, loss_sum, weight, grads, signals["stop"])
        return new_state, {**metrics, **extra}

    def apply_gradients(self, state, loss_sum, weight, grads, signals) -> tuple[dict, dict]:
        """The optimizer update from summed gradients (inside jit); ``(new_state, metrics)``.

        Args:
          state: ``{"step", "params", "opt_state", "rng"}``.
          loss_sum: float32 scalar, the summed token loss (nats).
          weight: float32 scalar, the summed loss mask (tokens).
          grads: Gradients of ``loss_sum``, shaped as the params.
          signals: The ``[num_devices]`` int32 stop-signal vector (`signals`'s ``stop``).

        A non-finite loss or gradient leaves parameters and optimizer state as they were
        (``metrics["finite"]`` is False); the step counter still advances. The guard is a `jax.lax.cond`
        around the update, not a `jnp.where` of new and old state: with the select, XLA keeps copies of the
        old moments (a third of the state per device), scheduled at the start of the step, through the peak.
        """
        denom = jnp.maximum(weight, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = optax.tree.norm(grads) if hasattr(getattr(optax, "tree", None), "norm") else optax.global_norm(grads)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])

        def commit(updates, new, params, old):
            return optax.apply_updates(params, updates), new

        # Outside the cond: every collective (the clipping norm); inside: elementwise work only, which a
        # pipeline's check of collectives in conditionals (`sharding.hlo.branch_collectives`) must not see.
        params, opt_state = jax.lax.cond(finite, commit, lambda updates, new, params, old: (params, old),
                                         updates, opt_state, state["params"], state["opt_state"])
        metrics = {"loss": loss_sum / denom, "grad_norm": grad_norm, "lr": self.schedule(state["step"]),
                   "tokens": weight, "finite": finite, "stop": jnp.max(signals) > 0}
        new_state = {"step": state["step"] + 1, "params": params, "opt_state": opt_state, "rng": state["rng"]}
        return new_state, metrics

    def signal_sharding(self) -> dict[str, NamedSharding]:
        """Shardings of the step's host inputs (`signals`): ``stop`` one entry per device, ``counts``
        (uneven strategy only) replicated."""
        out = {"stop": NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))}
        if isinstance(self.strategy, strategies.UnevenGradients):
            out["counts"] = self.replicated
        return out

    def signals(self, stop: bool, counts=None) -> dict[str, jax.Array]:
        """The step's per-step host inputs: ``stop``, this process's stop request as the global
        ``[num_devices]`` int32 vector, and for the uneven strategy ``counts``, int32 ``[groups along data
        x fsdp]`` microbatches per data-parallel group (default the strategy's counts; each at most its capacity,
        summing to the same total: they change without recompiling the step).

        The train step reduces ``stop`` with a max, so every process reads the same ``stop`` metric and all
        stop after the same step. Every process must pass the same ``counts``.

        Raises:
          ValueError: Counts of the wrong length or total, or above the buffer's capacity.
        """
        value = np.int32(1 if stop else 0)
        shardings = self.signal_sharding()
        out = {"stop": jax.make_array_from_callback((self.mesh.devices.size,), shardings["stop"],
                                                    lambda index: np.full((1,), value))}
        if "counts" in shardings:
            strategy = self.strategy
            counts = np.asarray(strategy.counts if counts is None else counts, np.int32)
            if (counts.shape != (len(strategy.counts),) or int(counts.sum()) != sum(strategy.counts)
                    or counts.min() < 0 or counts.max() > strategy.capacity):
                raise ValueError(f"uneven counts {counts.tolist()}: need {len(strategy.counts)} counts >= 0 summing "
                                 f"to {sum(strategy.counts)}, each at most --hetero-max-share {strategy.capacity}")
            out["counts"] = jax.make_array_from_callback(counts.shape, shardings["counts"], lambda index: counts[index])
        return out

    def _jit(self, kind: str, global_batch: int, seq_len: int):
        """The one jit builder: ``train`` ``(state, batch, signals) -> (state, metrics)`` (donating the state;
        ``signals`` as `signals` returns)
        or ``eval`` ``(params, batch) -> (loss_sum, weight_sum)``, with explicit shardings, cached."""
        key = (kind, global_batch, seq_len)
        if key not in self._jitted:
            if isinstance(self.par.strategy, UnevenBatch):
                strategies.check_uneven(self.par, self.param_names, self.abstract_params, global_batch)
            batch = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}
            if kind == "train":
                self._jitted[key] = jax.jit(self._step, in_shardings=(self.state_shardings, batch, self.signal_sharding()),
                                            out_shardings=(self.state_shardings, self.replicated), donate_argnums=0)
            else:
                self._jitted[key] = jax.jit(self.loss_sums, in_shardings=(self.param_shardings, batch),
                                            out_shardings=(self.replicated, self.replicated))
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

    def compile_train_step(self, global_batch: int, seq_len: int):
        """Ahead-of-time compiled train step from abstract shapes (no allocation)."""
        sizes = {"stop": self.mesh.devices.size, "counts": self.par.data_parallel}
        signals = {k: jax.ShapeDtypeStruct((sizes[k],), jnp.int32, sharding=sh)
                   for k, sh in self.signal_sharding().items()}
        return self.train_step(global_batch, seq_len).lower(
            self.abstract_state(), self.abstract_batch(global_batch, seq_len), signals).compile()


def param_bytes(tree) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in a tree."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
