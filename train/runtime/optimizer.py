"""The optimizer: optax AdamW (or Lion, SGD, Adafactor) with linear warmup, a decay and gradient clipping.

AdamW is Loshchilov & Hutter (2019); the schedule warms up linearly from
``lr / warmup`` (step 1) to ``lr`` (step ``warmup``), then follows a cosine to ``lr * min_lr_ratio``
at ``decay_steps`` (Loshchilov & Hutter, SGDR, 2017). Gradients are clipped
to a global norm first (Pascanu et al., 2013). Weight decay applies to
matrices only, not to norm scales or biases.

``--optimizer``: ``adamw`` (the default), ``lion`` (Chen et al., "Symbolic Discovery of
Optimization Algorithms", 2023), ``sgd`` (with momentum ``--beta1``) and ``adafactor`` (Shazeer & Stern,
"Adafactor: Adaptive Learning Rates with Sublinear Memory Cost", 2018: the second moment of a matrix kept as
its row and column means, update clipping at RMS 1, steps relative to the parameter's RMS, so ``--lr`` is a
relative step size; ``--eps`` is its regulariser of the squared gradient, optax's 1e-30 by default; weight
decay is decoupled and scaled by the schedule as AdamW's). ``--schedule``: ``cosine`` (above),
``linear`` (warmup, then a straight line to ``lr * min_lr_ratio``) or ``wsd``, warmup-stable-decay (Hu et
al., "MiniCPM", 2024): the peak rate until the last `WSD_DECAY_FRACTION` of the schedule, then a straight
line down (the fraction is our choice).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from sharding import axes as ax

OPTIMIZERS = ("adamw", "lion", "sgd", "adafactor")
"""``--optimizer`` choices (optax's implementations)."""
SCHEDULES = ("cosine", "linear", "wsd")
"""``--schedule`` choices."""
WSD_DECAY_FRACTION = 0.2
"""``--schedule wsd``: the share of the schedule's steps spent decaying at its end."""

# Which of --beta1/--beta2/--eps each optimizer reads, and their defaults (AdamW's are this project's
# long-standing ones; Lion's and Adafactor's are optax's; SGD's --beta1 is its momentum).
_HYPER = {
    "adamw": {"b1": 0.9, "b2": 0.95, "eps": 1e-8},
    "lion": {"b1": 0.9, "b2": 0.99},
    "sgd": {"b1": 0.9},
    "adafactor": {"eps": 1e-30},
}
_FLAGS = {"b1": "--beta1", "b2": "--beta2", "eps": "--eps"}


def optimizer_hyper(name: str, b1: float | None, b2: float | None, eps: float | None) -> dict[str, float]:
    """``{"b1", "b2", "eps"}`` of ``--optimizer name``: the given values or the optimizer's defaults.

    Raises:
      ValueError: A flag given to an optimizer that does not read it, naming it and those that do.
    """
    given = {"b1": b1, "b2": b2, "eps": eps}
    defaults = _HYPER[name]
    for key, value in given.items():
        if value is not None and key not in defaults:
            users = ", ".join(n for n, d in _HYPER.items() if key in d)
            raise ValueError(f"{_FLAGS[key]} {value}: --optimizer {name} has no such parameter (it applies to {users})")
    fields = OptimizerConfig.__dataclass_fields__
    return {key: value if value is not None else defaults.get(key, fields[key].default) for key, value in given.items()}


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Hyperparameters; ``decay_steps`` is the length of the schedule in steps; ``name`` one of `OPTIMIZERS`,
    ``schedule`` one of `SCHEDULES`; ``b1``/``b2``/``eps`` as each optimizer reads them (`optimizer_hyper`)."""

    lr: float = 3e-3
    warmup: int = 20
    decay_steps: int = 300
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    min_lr_ratio: float = 0.1
    name: str = "adamw"
    schedule: str = "cosine"

    def validate(self) -> None:
        """Raises ValueError naming the flag that is out of range (NaN and infinity included)."""
        for flag, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay), ("--grad-clip", self.grad_clip)):
            if not math.isfinite(value):
                raise ValueError(
                    f"{flag} {value}: must be a finite number, e.g. {flag} "
                    f"{OptimizerConfig.__dataclass_fields__[flag[2:].replace('-', '_')].default}"
                )
        if self.lr <= 0:
            raise ValueError(f"--lr {self.lr}: must be positive, e.g. --lr 3e-3")
        if self.warmup < 0:
            raise ValueError(f"--warmup {self.warmup}: must be >= 0")
        if self.decay_steps <= self.warmup:
            raise ValueError(
                f"--warmup {self.warmup} must be smaller than the schedule length {self.decay_steps} "
                f"(--steps/--decay-steps); e.g. --warmup {max(self.decay_steps // 10, 0)}"
            )
        if self.weight_decay < 0:
            raise ValueError(f"--weight-decay {self.weight_decay}: must be >= 0")
        if self.grad_clip <= 0:
            raise ValueError(f"--grad-clip {self.grad_clip}: must be positive, e.g. --grad-clip 1.0")
        for flag, value in (("--beta1", self.b1), ("--beta2", self.b2)):
            if not 0.0 <= value < 1.0:  # NaN fails too
                raise ValueError(f"{flag} {value}: must be >= 0 and < 1, e.g. {flag} 0.9")
        if not (math.isfinite(self.eps) and self.eps > 0):
            raise ValueError(f"--eps {self.eps}: must be a finite number > 0, e.g. --eps 1e-8")
        if self.name not in OPTIMIZERS or self.schedule not in SCHEDULES:
            raise ValueError(
                f"--optimizer {self.name} --schedule {self.schedule}: expected one of "
                f"{', '.join(OPTIMIZERS)} and one of {', '.join(SCHEDULES)}"
            )


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Linear warmup then cosine decay (see the module docstring), by optimizer update count.

    Update ``c`` (0-based: it trains step ``c + 1``) takes the rate of ``c + 1`` on optax's curve. optax's
    `warmup_cosine_decay_schedule` gives ``init_value`` (0) at count 0, so unshifted the first step would
    train at rate 0 and warm-up would waste a step; shifted, step 1 trains at ``lr / warmup``, step
    ``warmup`` at ``lr``, and step ``decay_steps`` at ``lr * min_lr_ratio``.
    """
    lr, end, warmup, total = config.lr, config.lr * config.min_lr_ratio, config.warmup, config.decay_steps
    if config.schedule == "cosine":
        curve = optax.warmup_cosine_decay_schedule(
            init_value=0.0, peak_value=lr, warmup_steps=warmup, decay_steps=total, end_value=end
        )
    elif config.schedule == "linear":
        curve = optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup), optax.linear_schedule(lr, end, total - warmup)], [warmup]
        )
    else:  # wsd: warmup, the peak, then the last WSD_DECAY_FRACTION of the steps straight down
        decay_start = max(warmup, total - math.ceil(WSD_DECAY_FRACTION * total))
        curve = optax.join_schedules(
            [
                optax.linear_schedule(0.0, lr, warmup),
                optax.constant_schedule(lr),
                optax.linear_schedule(lr, end, total - decay_start),
            ],
            [warmup, decay_start],
        )
    return lambda count: curve(count + 1)


def decay_mask(param_names) -> dict:
    """True for the matrices: parameters with an ``embed`` (or the experts' ``expert_embed``) dimension and
    two or more dimensions besides ``layers`` (the products' weights and the embedding); norm scales and the query/key/value biases
    (``[heads, head_dim]``, no ``embed``) are not decayed."""
    return jax.tree.map(
        lambda names: (ax.EMBED in names or ax.EXPERT_EMBED in names) and sum(n != ax.LAYERS for n in names) >= 2,
        param_names,
        is_leaf=lambda x: isinstance(x, tuple),
    )


ELEMENTWISE = ("adamw", "lion", "sgd")
"""Optimizers whose update after clipping is elementwise (no reduction over an array, hence no collective):
`GuardedUpdate` runs it inside the finite-step conditional. Adafactor's is not (row and column means, the
parameter's RMS), so it runs before the conditional."""


class GuardedUpdate:
    """The optimizer update of one step, skipped when the step is not finite.

    The optax chain is clipping by global norm (Pascanu et al., 2013), then ``config.name``'s optimizer on
    the schedule; its state is ``(clip_state, inner_state)`` as `optax.chain` makes it. `__call__` splits it
    where memory needs it: the clipping, whose global norm is a collective, runs before a `jax.lax.cond` on
    ``finite``; the inner optimizer's update (`ELEMENTWISE`) and the new parameters are computed inside the
    taken branch. Then XLA writes the new moments and parameters over the donated old ones, element by
    element: computed before the conditional, the new moments and the updates of every parameter would be
    live at once beside the old state, which the skipped branch still needs (a second copy of the state's
    moments and a parameter-sized update, in temporaries). No collective runs inside the conditional.

    Args:
      config: Hyperparameters (validated here).
      param_names: The parameter tree's logical names (for the decay mask, `decay_mask`).

    Attributes:
      tx: The whole `optax.GradientTransformation` (clipping, then the optimizer): its ``init`` makes the
        state `__call__` updates, and ``tx.update`` is the same update unguarded.

    Raises:
      ValueError: as `OptimizerConfig.validate`.
    """

    def __init__(self, config: OptimizerConfig, param_names):
        config.validate()
        self.clip = optax.clip_by_global_norm(config.grad_clip)
        self.inner = _optimizer(config, decay_mask(param_names))
        self.in_branch = config.name in ELEMENTWISE
        self.tx = optax.chain(self.clip, self.inner)

    def __call__(self, grads, opt_state, params, finite: jax.Array):
        """``(params, opt_state)`` after the update, or the given ones bit for bit when ``finite`` is False
        (inside jit).

        Args:
          grads: Mean gradients (float32), shaped as ``params``.
          opt_state: ``tx.init``'s structure, ``(clip_state, inner_state)``; the clipping keeps no state
            (`optax.EmptyState`).
          params: The parameters.
          finite: Boolean scalar, the same on every device: apply the update.
        """
        clip_state, inner_state = opt_state
        grads, _ = self.clip.update(grads, clip_state, params)
        if self.in_branch:

            def commit(grads, params, old):
                updates, new = self.inner.update(grads, old, params)
                return optax.apply_updates(params, updates), new

            operand = grads
        else:  # its reductions (collectives) stay outside the conditional
            operand, new_inner = self.inner.update(grads, inner_state, params)

            def commit(updates, params, old):
                return optax.apply_updates(params, updates), new_inner

        params, inner_state = jax.lax.cond(
            finite, commit, lambda _, params, old: (params, old), operand, params, inner_state
        )
        return params, (clip_state, inner_state)


def _optimizer(config: OptimizerConfig, mask) -> optax.GradientTransformation:
    """``config.name``'s optax transformation on the schedule, weight decay on ``mask``'s parameters."""
    schedule = learning_rate_schedule(config)
    if config.name == "adamw":
        return optax.adamw(
            schedule, b1=config.b1, b2=config.b2, eps=config.eps, weight_decay=config.weight_decay, mask=mask
        )
    if config.name == "lion":
        return optax.lion(schedule, b1=config.b1, b2=config.b2, weight_decay=config.weight_decay, mask=mask)
    if config.name == "adafactor":
        # optax adds Adafactor's decay after the learning rate: scaled by the schedule here, it decays as AdamW's
        return optax.adafactor(
            schedule,
            eps=config.eps,
            weight_decay_rate=lambda count: config.weight_decay * schedule(count),
            weight_decay_mask=mask,
        )
    return optax.chain(optax.add_decayed_weights(config.weight_decay, mask), optax.sgd(schedule, momentum=config.b1))
