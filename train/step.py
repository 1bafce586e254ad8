"""Train state, its shardings, and the jitted train and eval steps.

The train state is a dict::

    {"step": int32 [], "params": {...}, "opt_state": optax state, "rng": uint32 [2]}

Parameters are sharded by the logical rules (`sharding.rules.tree_shardings`),
the optimizer state like the parameters it belongs to (`optax.tree_map_params`),
scalars replicated. The state is created by one jitted init with
``out_shardings``, so it is never whole on one device, and the train step is
jitted with explicit in/out shardings and donates the state.

A global batch is a dict of ``[batch, length]`` arrays (`train.data.FIELDS`).
With ``microbatches = M`` it is split into M microbatches of strided rows
(row ``r`` goes to microbatch ``r % M``), which keeps every device's share of
each microbatch local; gradients are summed over a `jax.lax.scan` and divided
once by the batch's token count, so the update equals the one-shot update.

Pipeline parallelism (a ``stage`` mesh axis of size S > 1, `sharding.pipeline`):
the stacked layer parameters (and their optimizer state) live in the plan's
``[stage, slot, ...]`` layout, sharded over ``stage``; ``microbatches`` is then
the pipeline's microbatch count M (the batch flows through the stages as M
microbatches within one forward and backward pass, whose gradients the
pipeline's backward pass sums, so the update again equals the one-shot
update) and there is no separate accumulation loop. Checkpoints store the state as it is laid out,
with the layout in their metadata; `Trainer.restore` re-lays the stacked layer
axis on device when the saved layout differs from this run's (another stage
count or split, or none), so a run resumes across stage layouts.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.transformer import abstract_model, init_params, loss_sums
from sharding import axes as ax
from sharding.hlo import branch_collectives
from sharding.parallel import Accumulation, Parallelism
from sharding.pipeline import PipelinePlan, StageLayout, pipeline_rules, plan_layout, relayout_on_mesh
from sharding.rules import Rules, logical_to_spec, tree_shardings
from train.data import FIELDS
from train.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer

BATCH_NAMES = (ax.BATCH, ax.LENGTH)


@dataclasses.dataclass
class Trainer:
    """Everything needed to build, shard and step a model on one mesh.

    Args:
      config: the model.
      optimizer: optimizer hyperparameters.
      mesh: the `jax.sharding.Mesh`.
      rules: logical-to-mesh rules.
      microbatches: gradient-accumulation steps per global batch; with a
        ``stage`` axis > 1, the pipeline's microbatches (and no accumulation).
      context_layout: how batches lay tokens along the length, ``contiguous`` or
        ``zigzag`` (`train.data.context_permutation`; ring/ulysses attention only).
      pipeline: the stage layout and microbatches when the mesh has a ``stage``
        axis > 1; default an even GPipe split with ``microbatches``.

    Attributes:
      abstract_params, param_names: the model's parameters (canonical
        ``[layers, ...]`` stacks) and their logical names.
      layout: the run's `StageLayout`, or None (canonical, no pipeline).
      state_params: the parameters as the state holds them (in ``layout``).
      param_shardings, report: their shardings and the `ShardingReport`.

    Raises:
      ValueError: a pipeline whose stage count is not the mesh's, or as
        `sharding.pipeline.pipeline_rules`.
    """

    config: ModelConfig
    optimizer: OptimizerConfig
    mesh: Any
    rules: Rules
    microbatches: int = 1
    context_layout: str = "contiguous"
    pipeline: PipelinePlan | None = None

    def __post_init__(self):
        self.graphdef, self.abstract_params, self.param_names = abstract_model(self.config)
        self._setup_pipeline()
        self.tx = make_optimizer(self.optimizer, self.param_names)
        self.schedule = learning_rate_schedule(self.optimizer)
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.state_params, self.param_shardings, self.report, self.state_shardings = self._layout_state(self.layout)
        self._train_step = None
        self._eval_step = None
        self.notes: list[str] = []  # what the run should know (e.g. a pipeline fallback)

    def _setup_pipeline(self) -> None:
        """Sets ``pipeline``, ``layout``, the accumulation steps and, with stages, the pipeline rules."""
        stages = dict(self.mesh.shape).get(ax.STAGE, 1)
        if stages > 1 and self.pipeline is None:
            self.pipeline = PipelinePlan(plan_layout(self.config.num_layers, stages)[0], self.microbatches)
        if self.pipeline is not None and self.pipeline.layout.stages != stages:
            raise ValueError(f"the pipeline has {self.pipeline.layout.stages} stages but the mesh's stage axis is "
                             f"{stages}; pass --mesh stage={self.pipeline.layout.stages},...")
        if self.pipeline is not None:
            self.rules = pipeline_rules(self.rules)
            self.microbatches = self.pipeline.microbatches
        self.layout = self.pipeline.layout if self.pipeline is not None else None
        self.accumulation = 1 if self.pipeline is not None else self.microbatches
        strategy = self.pipeline if self.pipeline is not None else Accumulation(self.microbatches)
        self.par = Parallelism(dict(self.mesh.shape), self.rules, strategy, self.context_layout, mesh=self.mesh)

    def _is_layer_tree(self):
        """The params tree with True at the stacked layer parameters."""
        return {key: jax.tree.map(lambda _: key == "layers", value) for key, value in self.abstract_params.items()}

    def _layout_state(self, layout: StageLayout | None):
        """``(params, param_shardings, report, state_shardings)`` with the layer stacks in ``layout``."""
        is_layer = self._is_layer_tree()

        def shape(x, layer):
            return jax.ShapeDtypeStruct(layout.stacked_shape(x.shape), x.dtype) if layer and layout is not None else x

        def names(n, layer):
            return StageLayout.stacked_names(n) if layer and layout is not None else n

        params = jax.tree.map(shape, self.abstract_params, is_layer)
        param_names = jax.tree.map(names, self.param_names, is_layer, is_leaf=lambda x: isinstance(x, tuple))
        param_shardings, report = tree_shardings(params, param_names, self.mesh, self.rules)
        opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            jax.eval_shape(self.tx.init, params),
            param_shardings,
            transform_non_params=lambda _: self.replicated,
        )
        state_shardings = {
            "step": self.replicated,
            "params": param_shardings,
            "opt_state": opt_shardings,
            "rng": self.replicated,
        }
        return params, param_shardings, report, state_shardings

    # Shapes and shardings ------------------------------------------------------

    def abstract_state(self, layout: StageLayout | None | str = "run") -> dict:
        """The state as `jax.ShapeDtypeStruct`s carrying their shardings (restore targets).

        Args:
          layout: the layout of the layer stacks: this run's (default), or
            another (None: canonical), e.g. a checkpoint's before re-laying;
            then the stage dimension is split over this mesh's ``stage`` axis
            where it divides, else left whole along it.
        """
        if layout == "run" or layout == self.layout:
            shardings, layout = self.state_shardings, self.layout
        else:
            shardings = self._layout_state(layout)[3]
        shapes = jax.eval_shape(lambda seed: self._init_fn(seed, layout), jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)

    def batch_sharding(self, global_batch: int, seq_len: int) -> NamedSharding:
        """Sharding of one ``[batch, length]`` field of a global batch."""
        spec, _ = logical_to_spec(BATCH_NAMES, self.rules, (global_batch, seq_len), dict(self.mesh.shape))
        return NamedSharding(self.mesh, spec)

    def abstract_batch(self, global_batch: int, seq_len: int) -> dict:
        sharding = self.batch_sharding(global_batch, seq_len)
        dtypes = {"loss_mask": jnp.float32}
        return {
            f: jax.ShapeDtypeStruct((global_batch, seq_len), dtypes.get(f, jnp.int32), sharding=sharding)
            for f in FIELDS
        }

    # Init ------------------------------------------------------------------------

    def _init_fn(self, seed, layout: StageLayout | None | str = "run"):
        key = jax.random.key(seed)
        layout = self.layout if layout == "run" else layout
        table = None if layout is None else layout.layer_table()
        params = init_params(self.config, jax.random.fold_in(key, 0), table)
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)),
        }

    def init_state(self, seed: int) -> dict:
        """Fresh state, created sharded by a jitted init with ``out_shardings``.

        With a pipeline, each stage builds only its own slots; the values are
        those of the canonical model for the same seed, whatever the layout.
        """
        init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        return init(jnp.asarray(seed, jnp.int32))

    # Stage layouts and checkpoints ------------------------------------------------

    def layout_meta(self) -> dict | None:
        """This run's layout for checkpoint metadata (None: canonical ``[layers, ...]`` stacks)."""
        return None if self.layout is None else self.layout.to_meta()

    def relayout_state(self, state: dict, src: StageLayout | None) -> dict:
        """Re-lays the layer stacks of ``state`` (params and optimizer state) from ``src`` to this run's layout.

        Only the stacked layer arrays move; the rest is returned as it is. They
        move on device under `jax.jit` with this run's shardings as
        ``out_shardings``, each device receiving the rows of its stage (with
        a stage axis); no array is ever gathered on one device.
        """
        if src == self.layout:
            return state
        leaves, treedef = jax.tree.flatten(state)
        moving = treedef.flatten_up_to(self._layer_mask(state))
        targets = jax.tree.leaves(self.state_shardings)
        num_layers, dst = self.config.num_layers, self.layout
        picked = [i for i, layer in enumerate(moving) if layer]
        fn = jax.jit(lambda xs: relayout_on_mesh(xs, src, dst, num_layers, self.mesh),
                     out_shardings=[targets[i] for i in picked])
        for i, moved in zip(picked, fn([leaves[i] for i in picked]), strict=True):
            leaves[i] = moved
        return treedef.unflatten(leaves)

    def _layer_mask(self, state: dict) -> dict:
        """``state``'s structure with True at the stacked layer arrays (parameters and their optimizer moments)."""
        is_layer = self._is_layer_tree()
        opt = optax.tree_map_params(self.tx, lambda _, layer: layer, state["opt_state"], is_layer,
                                    transform_non_params=lambda _: False)
        return {"step": False, "params": is_layer, "opt_state": opt, "rng": False}

    def restore(self, manager, step: int | None = None) -> tuple[dict, dict]:
        """Restores a checkpoint onto this run's mesh and layout.

        Reads the saved layout from the checkpoint's metadata (``pipeline``;
        absent or None: canonical), restores onto targets in that layout with
        this mesh's shardings (every device reads only its slice), then
        re-lays the stacked layer axis on device (`relayout_state`).

        Args:
          manager: a `checkpoints.manager.CheckpointManager`.
          step: the step (default: latest).

        Returns:
          ``(state, meta)``.
        """
        meta = manager.read_meta(step)
        src = StageLayout.from_meta(meta.get("pipeline"))
        if src is not None and src.num_layers != self.config.num_layers:
            raise ValueError(f"the checkpoint's stage layout {src.describe()} has {src.num_layers} layers; the model "
                             f"has {self.config.num_layers}")
        state, meta = manager.restore(self.abstract_state(src), step)
        return self.relayout_state(state, src), meta

    # Steps -------------------------------------------------------------------------

    def loss_sums(self, params, batch, par: Parallelism | None = None) -> tuple[jax.Array, jax.Array]:
        """``(loss_sum, weight_sum)`` of a batch (inside jit) under ``par`` (default the run's)."""
        return loss_sums(self.graphdef, params, batch["tokens"], batch["targets"], batch["loss_mask"],
                         batch["positions"], batch["segment_ids"], self.par if par is None else par)

    def _gradients(self, params, batch):
        grad_fn = jax.value_and_grad(self.loss_sums, has_aux=True)
        m = self.accumulation  # 1 with a pipeline: its microbatches flow inside loss_sums
        if m == 1:
            (loss_sum, weight), grads = grad_fn(params, batch)
            return loss_sum, weight, grads

        def split(x):
            b = x.shape[0]
            return x.reshape(b // m, m, *x.shape[1:]).swapaxes(0, 1)

        def body(carry, micro):
            loss_acc, weight_acc, grad_acc = carry
            (loss_sum, weight), grads = grad_fn(params, micro)
            grad_acc = jax.tree.map(jnp.add, grad_acc, grads)
            return (loss_acc + loss_sum, weight_acc + weight, grad_acc), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, weight, grads), _ = jax.lax.scan(body, init, jax.tree.map(split, batch))
        return loss_sum, weight, grads

    def _train_step_fn(self, state, batch, signals):
        loss_sum, weight, grads = self._gradients(state["params"], batch)
        return self.apply_gradients(state, loss_sum, weight, grads, signals)

    def apply_gradients(self, state, loss_sum, weight, grads, signals) -> tuple[dict, dict]:
        """The optimizer update from summed gradients (inside jit); ``(new_state, metrics)``.

        Args:
          state: ``{"step", "params", "opt_state", "rng"}``.
          loss_sum: float32 scalar, the summed token loss (nats).
          weight: float32 scalar, the summed loss mask (tokens).
          grads: gradients of ``loss_sum``, shaped as the params.
          signals: the ``[num_devices]`` int32 stop-signal vector (`signals`).

        A non-finite loss or gradient leaves parameters and optimizer state as they were
        (``metrics["finite"]`` is False); the step counter still advances.
        """
        denom = jnp.maximum(weight, 1.0)
        grads = jax.tree.map(lambda g: g / denom, grads)
        grad_norm = _global_norm(grads)
        updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        finite = jnp.isfinite(loss_sum) & jnp.isfinite(grad_norm)
        keep = lambda new, old: jnp.where(finite, new, old)
        metrics = {
            "loss": loss_sum / denom,
            "grad_norm": grad_norm,
            "lr": self.schedule(state["step"]),
            "tokens": weight,
            "finite": finite,
            "stop": jnp.max(signals) > 0,
        }
        new_state = {
            "step": state["step"] + 1,
            "params": jax.tree.map(keep, params, state["params"]),
            "opt_state": jax.tree.map(keep, opt_state, state["opt_state"]),
            "rng": state["rng"],
        }
        return new_state, metrics

    def signal_sharding(self) -> NamedSharding:
        """Sharding of the ``[num_devices]`` int32 stop-signal vector: one entry per device."""
        return NamedSharding(self.mesh, PartitionSpec(tuple(self.mesh.axis_names)))

    def signals(self, stop: bool) -> jax.Array:
        """This process's stop request as the global ``[num_devices]`` signal vector.

        The train step reduces it with a max, so every process reads the same
        ``stop`` metric and all stop after the same step.
        """
        value = np.int32(1 if stop else 0)
        return jax.make_array_from_callback(
            (self.mesh.devices.size,), self.signal_sharding(), lambda index: np.full((1,), value)
        )

    def train_step(self, global_batch: int, seq_len: int):
        """The jitted step ``(state, batch, signals) -> (state, metrics)``; donates ``state``.

        Metrics are scalars: ``loss`` (nats per token), ``grad_norm`` (before
        clipping), ``lr`` (of this step), ``tokens`` (counted by the loss
        mask), ``finite`` (bool; when False the update was skipped) and
        ``stop`` (bool; some process asked to stop, see `signals`).

        With a pipeline, the step is compiled here once from abstract shapes
        (the caller's compile then hits JAX's cache) and checked with
        `_check_pipeline`.
        """
        if self._train_step is None:
            batch_shardings = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}

            def build():
                return jax.jit(
                    self._train_step_fn,
                    in_shardings=(self.state_shardings, batch_shardings, self.signal_sharding()),
                    out_shardings=(self.state_shardings, self.replicated),
                    donate_argnums=0,
                )

            signals = jax.ShapeDtypeStruct((self.mesh.devices.size,), jnp.int32, sharding=self.signal_sharding())
            args = (self.abstract_state(), self.abstract_batch(global_batch, seq_len), signals)
            self._train_step = self._check_pipeline(build, args)
        return self._train_step

    def _check_pipeline(self, build, args):
        """``build()``, after making sure no stage can wait on another inside a skipped slot.

        The pipeline skips empty slots with conditionals that stages take
        differently. Collectives GSPMD puts inside a layer are normally among
        devices of one stage, but if it chose one that could involve other
        stages (a ``collective-permute``), devices would wait forever. Then
        the plan falls back to computing every slot (`PipelinePlan.skip_empty`
        False), with a warning, and the step is rebuilt.
        """
        fn = build()
        if self.pipeline is None or not self.pipeline.skip_empty:
            return fn
        unsafe = [c for c in branch_collectives(fn.lower(*args).compile().as_text(), self.mesh) if not c.safe]
        if not unsafe:
            return fn
        self.pipeline = dataclasses.replace(self.pipeline, skip_empty=False)
        self.par = self.par.replace(strategy=self.pipeline)
        self._train_step = self._eval_step = None
        ops = ", ".join(sorted({f"{c.op} ({c.name})" for c in unsafe}))
        note = (f"pipeline: the partitioner put {ops} inside a skipped layer slot, where stages that skip it would "
                f"leave others waiting; this run computes every slot instead (empty slots cost compute too)")
        self.notes.append(note)
        warnings.warn(note, RuntimeWarning, stacklevel=3)
        return build()

    def eval_step(self, global_batch: int, seq_len: int):
        """The jitted ``(params, batch) -> (loss_sum, weight_sum)``."""
        if self._eval_step is None:
            batch_shardings = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}

            def fn(params, batch):
                return self.loss_sums(params, batch)

            def build():
                return jax.jit(
                    fn,
                    in_shardings=(self.param_shardings, batch_shardings),
                    out_shardings=(self.replicated, self.replicated),
                )

            params = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh),
                                  self.state_params, self.param_shardings)
            self._eval_step = self._check_pipeline(build, (params, self.abstract_batch(global_batch, seq_len)))
        return self._eval_step

    def compile_train_step(self, global_batch: int, seq_len: int):
        """Ahead-of-time compiled train step from abstract shapes (no allocation)."""
        step = self.train_step(global_batch, seq_len)
        signals = jax.ShapeDtypeStruct((self.mesh.devices.size,), jnp.int32, sharding=self.signal_sharding())
        return step.lower(self.abstract_state(), self.abstract_batch(global_batch, seq_len), signals).compile()


def _global_norm(tree) -> jax.Array:
    """L2 norm over all leaves (``optax.tree.norm`` where available)."""
    tree_utils = getattr(optax, "tree", None)
    if tree_utils is not None and hasattr(tree_utils, "norm"):
        return tree_utils.norm(tree)
    return optax.global_norm(tree)


def param_bytes(tree) -> int:
    """Total bytes of the arrays (or ShapeDtypeStructs) in a tree."""
    return int(sum(np.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree)))
