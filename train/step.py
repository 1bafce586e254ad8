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
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from models.config import ModelConfig
from models.transformer import abstract_model, apply, init_params
from sharding import axes as ax
from sharding.rules import Rules, logical_to_spec, tree_shardings, use_rules
from train.data import FIELDS
from train.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer

BATCH_NAMES = (ax.BATCH, ax.LENGTH)


def cross_entropy(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed token cross-entropy.

    Args:
      logits: ``[batch, length, vocab]`` float32.
      targets: ``[batch, length]`` int32.
      weights: ``[batch, length]`` float32 loss mask.

    Returns:
      ``(loss_sum, weight_sum)`` float32 scalars (nats).
    """
    losses = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(losses * weights), jnp.sum(weights)


@dataclasses.dataclass
class Trainer:
    """Everything needed to build, shard and step a model on one mesh.

    Args:
      config: the model.
      optimizer: optimizer hyperparameters.
      mesh: the `jax.sharding.Mesh`.
      rules: logical-to-mesh rules.
      microbatches: gradient-accumulation steps per global batch.
    """

    config: ModelConfig
    optimizer: OptimizerConfig
    mesh: Any
    rules: Rules
    microbatches: int = 1

    def __post_init__(self):
        self.graphdef, self.abstract_params, self.param_names = abstract_model(self.config)
        self.tx = make_optimizer(self.optimizer, self.param_names)
        self.schedule = learning_rate_schedule(self.optimizer)
        self.param_shardings, self.report = tree_shardings(
            self.abstract_params, self.param_names, self.mesh, self.rules
        )
        replicated = NamedSharding(self.mesh, PartitionSpec())
        self.replicated = replicated
        abstract_opt = jax.eval_shape(self.tx.init, self.abstract_params)
        opt_shardings = optax.tree_map_params(
            self.tx,
            lambda _, sharding: sharding,
            abstract_opt,
            self.param_shardings,
            transform_non_params=lambda _: replicated,
        )
        self.state_shardings = {
            "step": replicated,
            "params": self.param_shardings,
            "opt_state": opt_shardings,
            "rng": replicated,
        }
        self._train_step = None
        self._eval_step = None

    # Shapes and shardings ------------------------------------------------------

    def abstract_state(self) -> dict:
        """The state as `jax.ShapeDtypeStruct`s carrying their shardings (restore targets)."""
        shapes = jax.eval_shape(self._init_fn, jax.ShapeDtypeStruct((), jnp.int32))
        return jax.tree.map(
            lambda s, sh: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), shapes, self.state_shardings
        )

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

    def _init_fn(self, seed):
        key = jax.random.key(seed)
        params = init_params(self.config, jax.random.fold_in(key, 0))
        return {
            "step": jnp.zeros((), jnp.int32),
            "params": params,
            "opt_state": self.tx.init(params),
            "rng": jax.random.key_data(jax.random.fold_in(key, 1)),
        }

    def init_state(self, seed: int) -> dict:
        """Fresh state, created sharded by a jitted init with ``out_shardings``."""
        init = jax.jit(self._init_fn, out_shardings=self.state_shardings)
        return init(jnp.asarray(seed, jnp.int32))

    # Steps -------------------------------------------------------------------------

    def loss_sums(self, params, batch) -> tuple[jax.Array, jax.Array]:
        """``(loss_sum, weight_sum)`` of a batch (inside jit, under the rules)."""
        logits = apply(self.graphdef, params, batch["tokens"], batch["positions"], batch["segment_ids"])
        return cross_entropy(logits, batch["targets"], batch["loss_mask"])

    def _gradients(self, params, batch):
        grad_fn = jax.value_and_grad(self.loss_sums, has_aux=True)
        m = self.microbatches
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
        with use_rules(self.mesh, self.rules):
            loss_sum, weight, grads = self._gradients(state["params"], batch)
            denom = jnp.maximum(weight, 1.0)
            grads = jax.tree.map(lambda g: g / denom, grads)
            grad_norm = _global_norm(grads)
            updates, opt_state = self.tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
        # A non-finite loss or gradient leaves parameters and optimizer state as they were.
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
        """
        if self._train_step is None:
            batch_shardings = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}
            self._train_step = jax.jit(
                self._train_step_fn,
                in_shardings=(self.state_shardings, batch_shardings, self.signal_sharding()),
                out_shardings=(self.state_shardings, self.replicated),
                donate_argnums=0,
            )
        return self._train_step

    def eval_step(self, global_batch: int, seq_len: int):
        """The jitted ``(params, batch) -> (loss_sum, weight_sum)``."""
        if self._eval_step is None:
            batch_shardings = {f: self.batch_sharding(global_batch, seq_len) for f in FIELDS}

            def fn(params, batch):
                with use_rules(self.mesh, self.rules):
                    return self.loss_sums(params, batch)

            self._eval_step = jax.jit(
                fn,
                in_shardings=(self.param_shardings, batch_shardings),
                out_shardings=(self.replicated, self.replicated),
            )
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
