"""The train state's layout: its parameters, their storage and shardings, init, restore targets, relayout.

The train state is a dict::

    {"step": int32 [], "params": {...}, "opt_state": optax state, "rng": uint32 [2]}

Parameters are sharded by the logical rules (`sharding.rules.tree_shardings`), the optimizer state like
the parameters it belongs to (propagated through optax's init: a factored moment keeps the sharding of the
dimensions it keeps), scalars replicated. The state is created by one
jitted init with ``out_shardings``, so it is never whole on one device.

With a pipeline the stacked layer parameters (and their optimizer state) live unpadded as ``[rows, ...]``
(`sharding.pipeline.storage.StageStorage`): rows split evenly over ``stage`` and the batch axes the rules
shard layer parameters over, so a stage with fewer layers holds no padding; the stage program gathers its
own layers once per step. Checkpoints store the state as it is laid out, with the layout in their
metadata; `StateLayout.relayout_state` re-lays the stacked layer axis on device when a checkpoint's layout
differs (`checkpoints.manager.restore_state`: another storage, the canonical stack, or the padded
``[stage, slot, ...]`` layout of checkpoints saved before), so a run resumes across stage layouts.

`StateLayout` is the one owner of this: the train step (`train.runtime.step.Trainer`), checkpoint restore,
inference, generation and Hugging Face import and export all read it; none of them needs a train step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.lora import trainable, with_trainable
from models.transformer import abstract_model, init_params
from sharding import axes as ax
from sharding.parallel import Parallelism
from sharding.pipeline import StageLayout, relayout_on_mesh
from sharding.pipeline.storage import (
    StageStorage,
    spread_over_stage,
    stack_table,
    storage_axes,
    storage_for,
    storage_spec,
)
from sharding.rules import tree_shardings
from sharding.zero import master_spec
from train.runtime.optimizer import GuardedUpdate, OptimizerConfig


class StateLayout:
    """How one model's train state is laid out on one mesh: shapes, names, storage and shardings.

    Args:
      config: The model.
      par: The run's `sharding.parallel.Parallelism`, bound to a mesh (`Parallelism.on`); with a pipeline,
        its stage layout decides the layer stacks' storage.
      optimizer: The run's optimizer hyperparameters (the optimizer state the train state holds is theirs).
        None where a state is only read or written, never stepped (restoring parameters for inference or
        export, an imported step 0): the optimizer state's tree and shapes depend on the parameters' names
        alone (the weight-decay mask), not on the hyperparameters, so the defaults give the same targets and
        the same fresh state.

    Attributes:
      graphdef, abstract_params, param_names: The model's graph, its parameters (canonical ``[layers, ...]``
        stacks, `jax.ShapeDtypeStruct`) and their logical names.
      layout: The run's `StageLayout` (which layers each stage computes), or None (no pipeline).
      storage: How the state stores the layer stacks: the `StageStorage` of ``layout`` on this mesh
        (unpadded rows), or None (canonical ``[layers, ...]``, no pipeline).
      update: The step's `train.runtime.optimizer.GuardedUpdate` (the optimizer, skipped on a non-finite step).
      tx: The `optax.GradientTransformation` whose state ``opt_state`` is (``update.tx``).
      state_params, param_shardings, report, state_shardings: The parameters as the state holds them (in
        ``storage``), their shardings in the forward and backward, the `sharding.rules.ShardingReport`, and the
        whole state's shardings. With ``par.optimizer_sharding`` ``data`` (ZeRO stage 1, `sharding.zero`) the
        state's parameters and optimizer moments are also split over ``data`` (``state_shardings["params"]``
        differs from ``param_shardings``); the step gathers the parameters to ``param_shardings`` first.

    Raises:
      ValueError: A ``par`` not bound to a mesh, or a pipeline whose stage count is not the mesh's.
    """

    def __init__(self, config: ModelConfig, par: Parallelism, optimizer: OptimizerConfig | None = None):
        if par.mesh is None:
            raise ValueError("a state layout needs a Parallelism bound to a mesh (Parallelism.on(mesh))")
        self.config, self.par = config, par
        self.mesh, self.rules = par.mesh, par.rules
        self.graphdef, self.abstract_params, self.param_names = abstract_model(config)
        self.layout = par.pipeline.layout if par.pipeline is not None else None
        if self.layout is not None and self.layout.stages != par.mesh_shape[ax.STAGE]:
            raise ValueError(
                f"the pipeline has {self.layout.stages} stages but the mesh's stage axis is "
                f"{par.mesh_shape[ax.STAGE]}; pass --mesh stage={self.layout.stages},..."
            )
        self.storage = (
            None
            if self.layout is None
            else storage_for(
                self.layout,
                jax.tree.leaves(self.param_names["layers"], is_leaf=lambda x: isinstance(x, tuple)),
                self.rules,
                par.mesh_shape,
                par.pipeline.gather,
            )
        )
        # with adapters only they are trained: the optimizer and its state cover them alone (`models.lora`)
        self.update = GuardedUpdate(
            OptimizerConfig() if optimizer is None else optimizer, trainable(config, self.param_names)
        )
        self.tx = self.update.tx
        self.replicated = NamedSharding(self.mesh, PartitionSpec())
        self.state_params, self.param_shardings, self.report, self.state_shardings = self._layout_state(self.storage)
        self._init = None  # the jitted init (`init_state`), built on first use

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
        master = self._master_shardings(params, param_shardings)
        opt_shardings = self._optimizer_shardings(trainable(self.config, params), trainable(self.config, master))
        state_shardings = {
            "step": self.replicated,
            "params": master,
            "opt_state": opt_shardings,
            "rng": self.replicated,
        }
        return params, param_shardings, report, state_shardings

    def _master_shardings(self, params, param_shardings):
        """The shardings the state keeps its float32 parameters in: ``param_shardings`` (the layout the forward
        and backward see), or with ``optimizer_sharding`` ``data`` each also split over ``data``
        (`sharding.zero.master_spec`; the optimizer state follows them, `_optimizer_shardings`)."""
        if self.par.optimizer_sharding != ax.DATA:
            return param_shardings
        shape = self.par.mesh_shape
        return jax.tree.map(
            lambda p, s: NamedSharding(self.mesh, master_spec(p.shape, s.spec, shape)), params, param_shardings
        )

    def _optimizer_shardings(self, params, param_shardings):
        """The optimizer state's shardings, derived from the parameters' by optax's own init.

        The init is traced (`jax.eval_shape`, nothing allocated) on parameters that carry their shardings
        on a copy of the mesh with explicit axes, where JAX propagates shardings through each operation: a
        moment shaped as its parameter (AdamW's, Lion's) keeps the parameter's sharding, and Adafactor's
        factored second moment (a ``[..., rows]`` and a ``[..., columns]`` mean of a matrix's squared
        gradient; optax reduces the parameter along the dropped dimension) keeps the sharding of every
        dimension it keeps. Counts, placeholders and other scalars come out replicated.

        Args:
          params: The state's parameters (`jax.ShapeDtypeStruct`), in the state's storage.
          param_shardings: Their `NamedSharding`s on this mesh.

        Returns:
          A tree shaped as ``tx.init(params)`` of `NamedSharding`s on this (auto-axes) mesh.
        """
        names = self.mesh.axis_names
        explicit = Mesh(self.mesh.devices, names, axis_types=(AxisType.Explicit,) * len(names))
        typed = jax.tree.map(
            lambda p, s: jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=NamedSharding(explicit, s.spec)),
            params,
            param_shardings,
        )
        with jax.set_mesh(explicit):
            shapes = jax.eval_shape(self.tx.init, typed)

        def derived(x):
            entries = list(getattr(x.sharding, "spec", None) or ()) if x.ndim else []
            while entries and entries[-1] is None:  # as the rules write a spec (`sharding.rules`)
                entries.pop()
            return NamedSharding(self.mesh, PartitionSpec(*entries))

        # a leaf shaped as its parameter takes the parameter's own sharding (the same spec, written alike)
        return optax.tree_map_params(
            self.tx,
            lambda x, param, sharding: sharding if x.shape == param.shape else derived(x),
            shapes,
            params,
            param_shardings,
            transform_non_params=derived,
        )

    def _storage_shardings(self, layout, shardings, report):
        """Shardings (and report rows) re-made for a pipelined run or a `StageStorage` ``layout``: the layer
        stacks' rows (in a `StageStorage`) over ``stage`` and the storage axes, their other dimensions
        without them (`sharding.pipeline.storage.storage_spec`); in a pipelined run, the other parameters
        also split over ``stage`` where a dimension allows, whatever ``layout`` (`spread_over_stage`: every
        stage uses them whole, so GSPMD gathers them once per step, in the same all-gather as over ``fsdp``)."""
        names = jax.tree.leaves(self.param_names["layers"], is_leaf=lambda x: isinstance(x, tuple))
        # rows over the batch axes too (whole layers per device), or over ``stage`` alone with the features
        # split as the rules say (the per-microbatch gather's storage: `storage_axes`)
        whole = isinstance(layout, StageStorage) and layout.groups > 1
        axes = storage_axes(names, self.rules, self.par.mesh_shape, "once" if whole else "microbatch")
        shape = self.par.mesh_shape

        def spec(row):
            if row[0].startswith("layers/"):
                return storage_spec(row[4], layout.rows, shape, axes) if isinstance(layout, StageStorage) else row[4]
            return spread_over_stage(row[4], row[1], shape) if self.storage is not None else row[4]

        specs = [spec(row) for row in report.rows]
        report.rows = [(*row[:4], spec, row[5]) for row, spec in zip(report.rows, specs)]
        treedef = jax.tree.structure(shardings)
        return treedef.unflatten([NamedSharding(self.mesh, spec) for spec in specs]), report

    def param_specs(self):
        """The state's parameters' `PartitionSpec`s (a tree shaped as the params)."""
        return jax.tree.map(lambda s: s.spec, self.param_shardings)

    def abstract_state(
        self, layout: StageLayout | StageStorage | None | str = "run", adapters_only: bool = False
    ) -> dict:
        """The state as `jax.ShapeDtypeStruct`s carrying their shardings (restore targets).

        Args:
          layout: The layout of the layer stacks: this run's (default), or another (None: canonical),
            e.g. a checkpoint's before re-laying; its stage dimension is split over this mesh's ``stage``
            axis where it divides, else left whole along it.
          adapters_only: The state a checkpoint keeps when its base is by reference (`adapters_state`).
        """
        if layout == "run" or layout == self.storage:
            shardings, layout = self.state_shardings, self.storage
        else:
            shardings = self._layout_state(layout)[3]
        shapes = jax.eval_shape(lambda seed: self._init_fn(seed, layout), jax.ShapeDtypeStruct((), jnp.int32))
        out = jax.tree.map(lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, shardings)
        return self.adapters_state(out) if adapters_only else out

    def adapters_state(self, state: dict) -> dict:
        """What a checkpoint keeps of a state whose frozen base is stored by reference (the run's
        `checkpoints.meta.RunMeta.base`): the state with its parameters cut to the adapter factors
        (`models.lora.trainable`); the optimizer state covers them alone already. The same arrays, no copy.

        Raises:
          ValueError: A model without adapters (its parameters are all trained: none is by reference).
        """
        if not self.config.lora_rank:
            raise ValueError("only a model with low-rank adapters keeps its base by reference")
        return {**state, "params": trainable(self.config, state["params"])}

    def with_base(self, state: dict, base: dict) -> dict:
        """``state`` (`adapters_state`'s, in this run's layout) with the frozen base put back.

        Args:
          state: The adapters' state, re-laid to this run's storage (`relayout_state`).
          base: The base's parameters in the canonical layout on `param_targets`' shardings (no factors:
            `checkpoints.hf.load_params` of the run's base folder); donated to the re-lay.

        Returns:
          The whole state, laid out for this run.
        """
        base = self.relayout_state({"params": base}, None)["params"]
        return {**state, "params": with_trainable(self.config, base, state["params"])}

    def param_targets(self) -> dict:
        """The parameters in the canonical ``[layers, ...]`` layout as `jax.ShapeDtypeStruct`s carrying this
        mesh's shardings: where imported weights are read onto (`checkpoints.hf.load_params`)."""
        return self.abstract_state(None)["params"]

    # Init and layouts ----------------------------------------------------------------------------

    def _init_fn(self, seed, layout: StageLayout | StageStorage | None | str = "run"):
        key = jax.random.key(seed)
        layout = self.storage if layout == "run" else layout
        table = None if layout is None else stack_table(layout, self.config.num_layers)
        params = init_params(self.config, jax.random.fold_in(key, 0), table)
        return self._fresh(params, key)

    def _fresh(self, params, key) -> dict:
        """Step 0 of ``params``: a fresh optimizer state and the run's RNG (of ``key``)."""
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(trainable(self.config, params)),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)),
        }

    def init_state(self, seed: int) -> dict:
        """Fresh state, created sharded by a jitted init with ``out_shardings``.

        With a pipeline, each device builds only its own rows; the values are those of the canonical model
        for the same seed, whatever the layout. The seed is an argument of one jitted init per layout, built on
        the first call: later calls (another seed, a fresh state for a second run) reuse its compiled program.
        """
        if self._init is None:
            self._init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        return self._init(jnp.asarray(seed, jnp.int32))

    def state_from_params(self, params: dict, seed: int) -> dict:
        """Step 0 of given parameters (e.g. imported): a fresh optimizer state, the RNG of ``seed``, in this run's layout.

        Args:
          params: Canonical ``[layers, ...]`` stacks, float32, on this mesh (`param_targets`' shardings);
            donated.
          seed: As `init_state`'s.

        Returns:
          The state, laid out for this run (`relayout_state` from the canonical layout for a pipeline).
        """
        canonical = self.state_shardings if self.storage is None else self._layout_state(None)[3]
        params = self._with_adapters(params, seed, canonical["params"])
        fn = jax.jit(lambda p, s: self._fresh(p, jax.random.key(s)), out_shardings=canonical, donate_argnums=0)
        return self.relayout_state(fn(params, jnp.asarray(seed, jnp.int32)), None)

    def _with_adapters(self, params: dict, seed: int, shardings: dict) -> dict:
        """``params`` with the adapter factors they lack (imported base weights) freshly initialised as
        `init_state` makes them for ``seed`` (``B`` zero: the model starts as the imported one); unchanged
        without adapters or when they are present."""
        if not self.config.lora_rank or trainable(self.config, params):
            return params

        def adapters(seed):
            return trainable(self.config, init_params(self.config, jax.random.fold_in(jax.random.key(seed), 0)))

        fresh = jax.jit(adapters, out_shardings=trainable(self.config, shardings))(jnp.asarray(seed, jnp.int32))
        return with_trainable(self.config, params, fresh)

    def layout_meta(self) -> dict | None:
        """This run's storage for checkpoint metadata (None: canonical ``[layers, ...]`` stacks)."""
        return None if self.storage is None else self.storage.to_meta()

    def relayout_state(self, state: dict, src: StageLayout | StageStorage | None) -> dict:
        """Re-lays the layer stacks of ``state`` (params and optimizer state) from ``src`` to this run's storage.

        ``state`` may hold part of the state (some of its keys; some of the parameters, nested as they are:
        `adapters_state`'s, or ``{"params": base}``); the rest is neither needed nor returned.

        Only the stacked layer arrays move, on device under `jax.jit` with this run's shardings as
        ``out_shardings``, each device receiving the rows of its stage; no array is gathered on one device.
        """
        if src == self.storage:
            return state
        is_layer = {key: jax.tree.map(lambda _: key == "layers", value) for key, value in self.abstract_params.items()}
        mask = {"step": False, "params": _like(is_layer, state["params"]), "rng": False}
        if "opt_state" in state:
            mask["opt_state"] = optax.tree_map_params(
                self.tx,
                _moves_with_rows,
                state["opt_state"],
                trainable(self.config, is_layer),
                trainable(self.config, state["params"]),
                transform_non_params=lambda _: False,
            )
        leaves, treedef = jax.tree.flatten(state)
        moving = treedef.flatten_up_to({key: mask[key] for key in state})
        targets = jax.tree.leaves(_like(self.state_shardings, state))
        picked = [i for i, layer in enumerate(moving) if layer]
        fn = jax.jit(
            lambda xs: relayout_on_mesh(xs, src, self.storage, self.config.num_layers, self.mesh),
            out_shardings=[targets[i] for i in picked],
        )
        for i, moved in zip(picked, fn([leaves[i] for i in picked]), strict=True):
            leaves[i] = moved
        return treedef.unflatten(leaves)


def _like(full, part):
    """The part of ``full`` with the nested dict keys of ``part`` (below its dicts, ``full``'s subtrees whole)."""
    if isinstance(part, dict) and isinstance(full, dict):
        return {key: _like(full[key], value) for key, value in part.items()}
    return full


def _moves_with_rows(leaf, layer: bool, param) -> bool:
    """Whether an optimizer-state ``leaf`` of ``param`` moves with the layer stack's rows when re-laid.

    A moment shaped as its parameter does, and so does a factored moment that keeps the leading (rows)
    dimension; Adafactor's ``[1]`` placeholders (the unused half of its state) stay.

    Raises:
      ValueError: A layer stack's factored moment that dropped the rows dimension (Adafactor factors the two
        largest dimensions, so a stack of 128 or more layers can lose it): it cannot be split by stage.
    """
    if not layer or leaf.shape == (1,) != param.shape:
        return False
    if leaf.shape[:1] != param.shape[:1] or leaf.ndim < param.ndim - 1:
        raise ValueError(
            f"the optimizer state {leaf.shape} of the layer stack {param.shape} has no layer dimension "
            "(Adafactor factored it away), so it cannot be re-laid between stage layouts; use optimizer adamw"
        )
    return True
