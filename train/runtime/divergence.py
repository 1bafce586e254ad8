"""Divergence: a finite loss that grows past ``--max-loss`` stops the run as a non-finite one does.

A run whose learning rate is far too high (``--lr 1e10``) does not always reach NaN: its loss can stay finite
but enormous while the parameters grow to ~1e10, and every checkpoint saved meanwhile is useless. The guard
compares each step's training loss with a limit, either given (``--max-loss X``) or, by default (``auto``),

    max(2 x the loss of the run's first recorded step, 1.5 x ln(vocab_size)).

``ln(vocab_size)`` is the cross-entropy (nats per token) of predicting every token with equal probability,
which a freshly initialised model starts near; a model half again worse than that predicts nothing, and one
at twice the loss it started this run with (a fresh start or a resume) has lost what it learned. The
first factor keeps a resumed, well-trained run from stopping at a spike the second would allow.
"""

from __future__ import annotations

import math

AUTO_FACTOR = 2.0
"""``--max-loss auto``: this multiple of the run's first recorded loss..."""
UNIFORM_FACTOR = 1.5
"""... or this multiple of ln(vocab_size), the uniform predictor's loss, whichever is larger."""


def parse_max_loss(text: str) -> float | None:
    """``--max-loss auto|off|X`` -> None (auto), ``inf`` (off) or X.

    Raises:
      ValueError: Not auto, off or a finite number > 0; naming the flag.
    """
    value = str(text).strip().lower()
    if value == "auto":
        return None
    if value == "off":
        return math.inf
    try:
        limit = float(value)
    except ValueError:
        limit = math.nan
    if not (math.isfinite(limit) and limit > 0):
        raise ValueError(f"--max-loss {text}: must be auto, off or a finite number > 0, e.g. --max-loss 20")
    return limit


def auto_max_loss(first_loss: float, vocab_size: int) -> float:
    """The ``auto`` limit: ``max(2 * first_loss, 1.5 * ln(vocab_size))`` (nats per token)."""
    return max(AUTO_FACTOR * first_loss, UNIFORM_FACTOR * math.log(max(vocab_size, 2)))


class DivergenceGuard:
    """Checks each recorded step's (finite) training loss against the run's limit.

    Args:
      limit: ``--max-loss``: a number, ``inf`` (off) or None (auto: `auto_max_loss` of the first loss checked).
      vocab_size: the model's vocabulary, for the auto limit.
    """

    def __init__(self, limit: float | None, vocab_size: int):
        self.limit, self.vocab_size = limit, vocab_size
        self.threshold: float | None = limit

    def check(self, step: int, loss: float) -> str | None:
        """None while ``loss`` stays within the limit, else the one-line reason the run stops."""
        if self.threshold is None:
            self.threshold = auto_max_loss(loss, self.vocab_size)
            self.first = (step, loss)
            return None
        if loss <= self.threshold:
            return None
        how = (
            "given"
            if self.limit is not None
            else (
                f"auto: max({AUTO_FACTOR:g} x step {self.first[0]}'s loss {self.first[1]:.4g}, "
                f"{UNIFORM_FACTOR:g} x ln {self.vocab_size})"
            )
        )
        return (
            f"the loss diverged at step {step}: {loss:.6g} > --max-loss {self.threshold:.6g} ({how}); training "
            f"stopped and the last checkpoint from before the divergence is kept (lower --lr, or pass a larger "
            f"--max-loss, or --max-loss off)"
        )
