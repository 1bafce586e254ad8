"""Text generation: a key/value cache, a jitted prefill and a jitted one-token decoding step, sampling.

Einsum letters as in `models.attention`: B batch, S cache length, K kv heads, H head_dim, V vocab.

Prompts of different lengths are right-padded into one ``[B, P]`` batch. The prefill runs all
``P`` positions (causal, so a row's real tokens never see its padding) and writes every
position's keys and values into the cache ``[layers, B, S, K, H]``; each row's first new token
comes from the logits at its last real position. Decoding step ``j`` feeds row b's latest token
at position ``length[b] + j``: it overwrites whatever padding was there and attends only to
positions up to its own (`models.attention.Attention.extend`). So every row computes what it
would alone.

The cache and every activation are sharded by the run's rules through ``par`` (batch over the
data axes, key/value heads over ``tensor``; the cache's length dimension stays whole). A row
stops at the end-of-document token; generation stops when every row has, or after
``max_new_tokens``.

Sampling: greedy at temperature 0; otherwise logits divided by the temperature, cut to the
``top_k`` most likely tokens (Fan et al., 2018, "Hierarchical Neural Story Generation") and to
the smallest set whose probability reaches ``top_p`` (nucleus sampling; Holtzman et al., 2020,
"The Curious Case of Neural Text Degeneration", section 3.1), then drawn with
`jax.random.categorical` from a key folded from ``seed`` and the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from models.config import ModelConfig
from models.transformer import extend
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.parallel import Parallelism

CACHE_NAMES = (ax.LAYERS, ax.BATCH, None, ax.KV_HEADS, ax.HEAD_DIM)
"""Logical names of a cache array ``[layers, batch, max_length, kv_heads, head_dim]``."""


@dataclasses.dataclass(frozen=True)
class Sampling:
    """How the next token is chosen.

    Attributes:
      temperature: 0 for greedy (argmax); else the logits are divided by it.
      top_k: keep only the k most likely tokens (0: all).
      top_p: keep the smallest set of most likely tokens whose probability reaches p (1: all).
      seed: the random seed of the draws.
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # nan compares false: refused here
            raise ConfigError(
                Field("temperature", self.temperature), ": must be a finite number >= 0 (0 is greedy), e.g. 0.8"
            )
        if self.top_k < 0:
            raise ConfigError(Field("top_k", self.top_k), ": must be >= 0 (0 keeps every token), e.g. 50")
        if not 0 < self.top_p <= 1:
            raise ConfigError(Field("top_p", self.top_p), ": must be in (0, 1], e.g. 0.9")


def sample(logits: jax.Array, key: jax.Array, sampling: Sampling) -> jax.Array:
    """Next tokens ``[batch]`` int32 from logits ``[batch, vocab]`` float32 (module docstring)."""
    if sampling.temperature == 0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = logits.astype(jnp.float32) / sampling.temperature
    if 0 < sampling.top_k < logits.shape[-1]:
        kth = jax.lax.top_k(logits, sampling.top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if sampling.top_p < 1:
        ordered = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(ordered, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # probability of the more likely tokens
        kept = jnp.where(before < sampling.top_p, ordered, jnp.inf)  # the first is always kept
        logits = jnp.where(logits < jnp.min(kept, axis=-1, keepdims=True), -jnp.inf, logits)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


def cache_shape(config: ModelConfig, batch: int, max_length: int) -> tuple[int, ...]:
    """``[layers, batch, max_length, kv_heads, head_dim]``."""
    return (config.num_layers, batch, max_length, config.num_kv_heads, config.head_dim)


def init_cache(config: ModelConfig, batch: int, max_length: int, par: Parallelism) -> dict[str, jax.Array]:
    """A zero key/value cache ``{"k", "v"}`` in the compute dtype, sharded by ``par``'s rules.

    Bytes: ``2 * layers * batch * max_length * kv_heads * head_dim * itemsize``.
    """
    shape = cache_shape(config, batch, max_length)
    sharding = par.sharding(CACHE_NAMES, shape) if par.is_sharded else None
    dtype = jnp.dtype(config.dtype)
    make = jax.jit(
        lambda: {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)},
        out_shardings={"k": sharding, "v": sharding} if sharding is not None else None,
    )
    return make()


class Generator:
    """Jitted prefill and decoding step for one model, parameters and layout.

    Args:
      config: the model.
      graphdef: its `nnx.GraphDef` (`models.transformer.abstract_model`).
      params: the params tree, already on ``par``'s mesh.
      par: the run's layout (`sharding.parallel.Parallelism`; no pipeline).
    """

    def __init__(self, config: ModelConfig, graphdef, params: dict[str, Any], par: Parallelism):
        self.config, self.graphdef, self.params, self.par = config, graphdef, params, par
        self._compiled: dict[Sampling, tuple[Callable, Callable]] = {}

    def functions(self, sampling: Sampling):
        """The jitted ``(prefill, step)`` for ``sampling`` (compiled on first use, then kept).

        ``prefill(params, cache, tokens [B, P], lengths [B]) -> (next [B], cache)``;
        ``step(params, cache, token [B], position [B], index) -> (next [B], cache)``; the cache is donated.
        """
        if sampling in self._compiled:
            return self._compiled[sampling]
        graphdef, par = self.graphdef, self.par
        key = jax.random.key(sampling.seed)

        def prefill(params, cache, tokens, lengths):
            logits, cache = extend(graphdef, params, cache, tokens, jnp.zeros_like(lengths), par)
            last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None], axis=1)[:, 0]
            return sample(last, jax.random.fold_in(key, 0), sampling), cache

        def step(params, cache, token, position, index):
            logits, cache = extend(graphdef, params, cache, token[:, None], position, par)
            return sample(logits[:, 0], jax.random.fold_in(key, index), sampling), cache

        functions = (jax.jit(prefill, donate_argnums=1), jax.jit(step, donate_argnums=1))
        self._compiled[sampling] = functions
        return functions

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        sampling: Sampling = Sampling(),
        eod_id: int | None = None,
        on_tokens: Callable[[np.ndarray, np.ndarray], None] | None = None,
    ) -> list[list[int]]:
        """Continues each prompt.

        Args:
          prompts: token ids per prompt (each non-empty; lengths may differ).
          max_new_tokens: the most new tokens per prompt.
          sampling: `Sampling`.
          eod_id: a row stops after producing this token (it is kept in the output), or None.
          on_tokens: called after each step with ``(tokens [batch] int, active [batch] bool)``,
            the step's tokens and which rows they extend (for streaming).

        Returns:
          The new tokens of each prompt (prompt excluded).

        Raises:
          ValueError: an empty prompt or a non-positive ``max_new_tokens``.
        """
        if max_new_tokens <= 0:
            raise ConfigError(Field("max_new_tokens", max_new_tokens), ": must be positive, e.g. 64")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ConfigError(Field("prompt"), ": every prompt needs at least one token")
        prefill, step = self.functions(sampling)
        lengths = np.array([len(p) for p in prompts], np.int32)
        batch, width = len(prompts), int(lengths.max())
        tokens = np.zeros((batch, width), np.int32)
        for row, prompt in enumerate(prompts):
            tokens[row, : len(prompt)] = prompt
        cache = init_cache(self.config, batch, width + max_new_tokens, self.par)
        shard = self._batch_sharding
        token, cache = prefill(self.params, cache, shard(tokens), shard(lengths))
        out: list[list[int]] = [[] for _ in prompts]
        active = np.ones(batch, bool)
        for index in range(max_new_tokens):
            following = None
            if index + 1 < max_new_tokens:  # dispatch the next step before reading this one's tokens
                following, cache = step(self.params, cache, token, shard(lengths + index), index + 1)
            host = np.asarray(token)
            for row in np.flatnonzero(active):
                out[row].append(int(host[row]))
            if on_tokens is not None:
                on_tokens(host, active.copy())
            if eod_id is not None:
                active &= host != eod_id
            if not active.any() or following is None:
                break
            token = following
        return out

    def _batch_sharding(self, array: np.ndarray) -> jax.Array:
        names = (ax.BATCH,) + (ax.LENGTH,) * (array.ndim - 1)
        if not self.par.is_sharded:
            return jnp.asarray(array)
        return jax.device_put(array, self.par.sharding(names, array.shape))
