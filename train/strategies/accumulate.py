"""Gradient accumulation: the batch in M strided microbatches, gradients summed over a loop."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from train.strategies.protocol import GradientStrategy, LossFn


class AccumulatedGradients(GradientStrategy):
    """Gradient accumulation over ``par.strategy.microbatches`` strided microbatches (1: none).

    Row ``r`` of the batch goes to microbatch ``r % M``, so each device's share of a microbatch stays on it;
    the gradients are summed over a `jax.lax.scan`.
    """

    def __init__(self, par, layout=None):
        super().__init__(par, layout)
        self.microbatches = par.strategy.microbatches

    def gradients(self, loss_fn: LossFn, params, batch: dict, inputs=None):
        grad_fn = jax.value_and_grad(lambda p, b: loss_fn(p, b, self.par), has_aux=True)
        m = self.microbatches
        if m == 1:
            (loss_sum, weight), grads = grad_fn(params, batch)
            return loss_sum, weight, grads, {}

        def split(x):
            return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

        def body(carry, micro):
            loss_acc, weight_acc, grad_acc = carry
            (loss_sum, weight), grads = grad_fn(params, micro)
            return (loss_acc + loss_sum, weight_acc + weight, jax.tree.map(jnp.add, grad_acc, grads)), None

        zeros = jax.tree.map(jnp.zeros_like, params)
        init = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.float32), zeros)
        (loss_sum, weight, grads), _ = jax.lax.scan(body, init, jax.tree.map(split, batch))
        return loss_sum, weight, grads, {}
