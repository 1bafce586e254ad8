"""Direct Preference Optimization (Rafailov et al., 2023, "Direct Preference Optimization: Your Language
Model is Secretly a Reward Model", eq. 7) on low-rank adapters.

For a prompt ``x`` with a preferred reply ``y_w`` and a rejected one ``y_l``, the loss is
``-log sigmoid(beta * ((log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))``, ``pi`` the
trained model, ``ref`` the frozen reference. Here the policy is the model with its adapters (`models.lora`)
and the reference the same parameters with every adapter factor zero: the base model, so no second copy of
the weights is held. ``beta * (log pi(y|x) - log ref(y|x))`` is the implicit reward of a reply (section 5);
the reward margin is the chosen reply's minus the rejected one's, and a pair counts as right when it is > 0.

A batch row holds one pair side by side: ``[chosen (T) | rejected (T)]`` as two packed documents (segment ids
1 and 2, positions from 0 in each), so the model's masks keep them apart and the strategies, microbatches and
shardings of ordinary batches apply unchanged (`train.data.preference`). ``loss_mask`` marks the replies'
target tokens; a reply's log-probability is the sum over its marked targets.

Einsum letters: B pairs (rows), T length of one reply's half, V vocab.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from models.lora import trainable, with_trainable
from models.transformer import apply
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.parallel import Parallelism
from train.runtime.step import Trainer


def pair_logps(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Summed log-probabilities of each row's two replies.

    Args:
      logits: ``[B, 2T, V]`` float32 next-token logits of rows ``[chosen | rejected]``.
      targets: ``[B, 2T]`` int32 next tokens.
      mask: ``[B, 2T]`` float32, 1 on the replies' targets.

    Returns:
      ``(chosen [B], rejected [B])`` float32 log-probabilities (nats, <= 0).
    """
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0] * mask
    half = targets.shape[1] // 2
    return jnp.sum(picked[:, :half], axis=1), jnp.sum(picked[:, half:], axis=1)


def dpo_terms(policy: tuple[jax.Array, jax.Array], reference: tuple[jax.Array, jax.Array], beta: float):
    """Per pair ``(loss, margin)``, each ``[B]`` float32: ``-log sigmoid(margin)`` and the reward margin
    ``beta * ((pi_w - ref_w) - (pi_l - ref_l))`` of (chosen, rejected) log-probabilities (module docstring)."""
    (pw, pl), (rw, rl) = policy, reference
    margin = beta * ((pw - rw) - (pl - rl))
    return -jax.nn.log_sigmoid(margin), margin


def check_dpo(config, beta: float) -> None:
    """Raises `ConfigError` for DPO without adapters (the reference is the model without them) or a
    ``dpo_beta`` that is not a finite positive number, naming the field and a value that works."""
    if not config.lora_rank:
        raise ConfigError(
            "DPO trains low-rank adapters (its frozen reference is the model without them); add ",
            Field("lora_rank", 16),
        )
    if not (beta > 0 and beta < float("inf")):
        raise ConfigError(Field("dpo_beta", beta), ": must be a finite number > 0, e.g. ", Field("dpo_beta", 0.1))


class DPOTrainer(Trainer):
    """`train.runtime.step.Trainer` whose objective is the DPO loss summed over pairs (module docstring).

    The step divides by the pairs (its ``weight``) as the language-model step divides by tokens, so
    ``loss`` is the mean DPO loss; its metrics add ``reward_margin`` (mean) and ``reward_accuracy`` (the
    share of pairs with a positive margin). The reference log-probabilities are computed in the same step
    from the parameters with the factors zeroed, outside the gradient.

    Args:
      config, optimizer, par: As `Trainer`; ``config`` must have adapters.
      beta: DPO's ``beta``, the strength of the pull toward the reference.

    Raises:
      ConfigError: As `check_dpo`.
    """

    def __init__(self, config, optimizer, par: Parallelism, beta: float):
        check_dpo(config, beta)
        super().__init__(config, optimizer, par)
        self.beta = beta

    def pair_sums(self, params, batch, par: Parallelism | None = None):
        """``(loss_sum, (pairs, {"reward_margin_sum", "reward_accuracy_sum"}))`` of a batch (inside jit)."""
        par = self.par if par is None else par
        graphdef = self.state_layout.graphdef
        inputs = (batch["tokens"], batch["positions"], batch["segment_ids"])

        def logps(p):
            logits = par.constrain(apply(graphdef, p, *inputs, par=par), (ax.BATCH, ax.LENGTH, ax.VOCAB))
            return pair_logps(logits, batch["targets"], batch["loss_mask"])

        zeros = jax.tree.map(jnp.zeros_like, trainable(self.config, params))
        reference = jax.lax.stop_gradient(logps(with_trainable(self.config, params, zeros)))
        loss, margin = dpo_terms(logps(params), reference, self.beta)
        pairs = jnp.asarray(loss.shape[0], jnp.float32)
        stats = {"reward_margin_sum": jnp.sum(margin), "reward_accuracy_sum": jnp.sum((margin > 0).astype(jnp.float32))}
        return jnp.sum(loss), (pairs, stats)

    def gradients(self, params, batch, inputs=None):
        """The strategy's ``(loss_sum, pairs, grads, metrics)`` of the DPO objective, gradients of the adapter
        factors alone (`models.lora.trainable`)."""

        def loss_fn(part, b, par=None):
            return self.pair_sums(with_trainable(self.config, params, part), b, par)

        return self.strategy.gradients(loss_fn, trainable(self.config, params), batch, inputs or {})

    def eval_pairs(self, global_batch: int, seq_len: int):
        """The jitted ``(params, batch) -> {"loss_sum", "pairs", "reward_margin_sum", "reward_accuracy_sum"}``
        of held-out pairs (rows ``[chosen | rejected]`` of ``seq_len`` tokens), replicated float32 scalars."""
        key = ("pairs", global_batch, seq_len)
        if key not in self._jitted:
            batch = {f: self.batch_sharding(global_batch, seq_len) for f in self.abstract_batch(1, 1)}

            def run(params, b):
                loss_sum, (pairs, stats) = self.pair_sums(params, b)
                return {"loss_sum": loss_sum, "pairs": pairs, **stats}

            self._jitted[key] = jax.jit(
                run, in_shardings=(self.state_layout.param_shardings, batch), out_shardings=self.replicated
            )
        return self._jitted[key]
