"""The optimizer: optax AdamW with linear warmup, cosine decay and gradient clipping.

AdamW is Loshchilov & Hutter (2019); the schedule warms up linearly from
``lr / warmup`` (step 1) to ``lr`` (step ``warmup``), then follows a cosine to ``lr * min_lr_ratio``
at ``decay_steps`` (Loshchilov & Hutter, SGDR, 2017). Gradients are clipped
to a global norm first (Pascanu et al., 2013). Weight decay applies to
matrices only, not to norm scales or biases.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import optax

from sharding import axes as ax


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """Hyperparameters; ``decay_steps`` is the length of the schedule in steps."""

    lr: float = 3e-3
    warmup: int = 20
    decay_steps: int = 300
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    min_lr_ratio: float = 0.1

    def validate(self) -> None:
        """Raises ValueError naming the flag that is out of range (NaN and infinity included)."""
        for flag, value in (("--lr", self.lr), ("--weight-decay", self.weight_decay), ("--grad-clip", self.grad_clip)):
            if not math.isfinite(value):
                raise ValueError(f"{flag} {value}: must be a finite number, e.g. {flag} "
                                 f"{OptimizerConfig.__dataclass_fields__[flag[2:].replace('-', '_')].default}")
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


def learning_rate_schedule(config: OptimizerConfig) -> optax.Schedule:
    """Linear warmup then cosine decay (see the module docstring), by optimizer update count.

    Update ``c`` (0-based: it trains step ``c + 1``) takes the rate of ``c + 1`` on optax's curve. optax's
    `warmup_cosine_decay_schedule` gives ``init_value`` (0) at count 0, so unshifted the first step would
    train at rate 0 and warm-up would waste a step; shifted, step 1 trains at ``lr / warmup``, step
    ``warmup`` at ``lr``, and step ``decay_steps`` at ``lr * min_lr_ratio``.
    """
    curve = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=config.lr,
        warmup_steps=config.warmup,
        decay_steps=config.decay_steps,
        end_value=config.lr * config.min_lr_ratio,
    )
    return lambda count: curve(count + 1)


def decay_mask(param_names) -> dict:
    """True for the matrices: parameters with an ``embed`` dimension and two or more dimensions besides
    ``layers`` (the products' weights and the embedding); norm scales and the query/key/value biases
    (``[heads, head_dim]``, no ``embed``) are not decayed."""
    return jax.tree.map(
        lambda names: ax.EMBED in names and sum(n != ax.LAYERS for n in names) >= 2,
        param_names,
        is_leaf=lambda x: isinstance(x, tuple),
    )


def make_optimizer(config: OptimizerConfig, param_names) -> optax.GradientTransformation:
    """The optax chain: clip by global norm, then AdamW on the schedule.

    Args:
      config: hyperparameters (validated here).
      param_names: the parameter tree's logical names (for the decay mask).

    Raises:
      ValueError: as `OptimizerConfig.validate`.
    """
    config.validate()
    return optax.chain(
        optax.clip_by_global_norm(config.grad_clip),
        optax.adamw(
            learning_rate_schedule(config),
            b1=config.b1,
            b2=config.b2,
            eps=config.eps,
            weight_decay=config.weight_decay,
            mask=decay_mask(param_names),
        ),
    )
