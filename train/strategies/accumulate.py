"""Gradient accumulation: the batch in M strided microbatches, gradients summed over a loop; with M = 1 (or
a pipelined model, which runs its own microbatches inside one pass) one forward and backward pass."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from train.strategies.protocol import GradientStrategy, LossFn


class AccumulatedGradients(GradientStrategy):
    """Gradient accumulation over ``par.strategy.microbatches`` strided microbatches (1: none).

    Row ``r`` of the batch goes to microbatch ``r % M``, so each device's share of a microbatch stays on it;
    the gradients are summed over a `jax.lax.scan`. With a pipeline in ``par`` (`Parallelism.pipeline`) the
    model runs the pipeline's microbatches itself inside one forward and backward pass, and the layout's
    strategy is one pass (`Parallelism` refuses any other beside a pipeline), so the whole batch is one pass here.
    """

    def __init__(self, par, layout=None):
        super().__init__(par, layout)
        self.microbatches = par.strategy.microbatches

    reports_stats = True

    def gradients(self, loss_fn: LossFn, params, batch: dict, inputs=None):
        def with_stats(p, b):
            loss_sum, aux = loss_fn(p, b, self.par)
            return loss_sum, aux if isinstance(aux, tuple) else (aux, {})

        grad_fn = jax.value_and_grad(with_stats, has_aux=True)
        m = self.microbatches
        if m == 1:
            (loss_sum, (weight, stats)), grads = grad_fn(params, batch)
            return loss_sum, weight, grads, self.stats_metrics(stats, weight)

        def split(x):
            return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

        def body(carry, micro):
            loss_acc, aux_acc, grad_acc = carry
            (loss_sum, aux), grads = grad_fn(params, micro)
            return (
                loss_acc + loss_sum,
                jax.tree.map(jnp.add, aux_acc, aux),
                jax.tree.map(jnp.add, grad_acc, grads),
            ), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        micro = jax.tree.map(split, batch)
        aux_shape = jax.eval_shape(lambda p, b: with_stats(p, b)[1], params, jax.tree.map(lambda x: x[0], micro))
        init = (jnp.zeros((), jnp.float32), jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), aux_shape), zeros)
        (loss_sum, (weight, stats), grads), _ = jax.lax.scan(body, init, micro)
        return loss_sum, weight, grads, self.stats_metrics(stats, weight)
