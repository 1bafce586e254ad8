"""Output projection and token cross-entropy in one call: gathered, or vocabulary-parallel.

Einsum letters: B batch, T length, D embed, V vocab (M: tokens, B x T flattened).

`output_loss_sums` takes the final activations ``[B, T, D]`` and the output weight (``unembed
[D, V]``, or the embedding table ``[V, D]`` when tied) and returns the summed cross-entropy of
the targets. How the work is laid out follows ``ModelConfig.logits`` and
`sharding.vocab.choose_output`:

==============  ===================================================================================
gathered        logits ``[B, T, V]`` as one einsum partitioned by GSPMD (the weight gathered over the
                axes that split its ``embed`` dimension), then the cross-entropy
vocab_parallel  Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al., 2019, section 3)
                over the axes that split the weight's ``embed`` dimension, per device under
                `jax.shard_map` with specs from the rules (`_vocab_parallel`)
auto            vocab_parallel where it moves fewer bytes (`sharding.vocab.output_traffic`)
==============  ===================================================================================

Where the run's `sharding.parallel.Parallelism` shards nothing (one device, or per-device code
inside another `shard_map`) the loss is computed directly. Both paths compute the same sums; their gradients agree to float32 rounding.
No mesh-axis names appear here: they come from the rules.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec

from sharding import axes as ax
from sharding.parallel import Parallelism
from sharding.rules import logical_to_spec
from sharding.vocab import VocabSplit, choose_for_batch


def project_logits(x: jax.Array, w: jax.Array, vocab_last: bool = True) -> jax.Array:
    """Logits ``[B, T, V]`` in float32 from activations and the output weight.

    Args:
      x: ``[B, T, D]`` activations in the compute dtype.
      w: ``[D, V]`` (``vocab_last``) or ``[V, D]`` weight (float32; cast to x's dtype).
      vocab_last: the weight's layout.
    """
    return jnp.einsum("BTD,DV->BTV" if vocab_last else "BTD,VD->BTV", x, w.astype(x.dtype)).astype(jnp.float32)


def cross_entropy_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array) -> tuple[jax.Array, jax.Array]:
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


def output_loss_sums(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    *,
    impl: str = "auto",
    vocab_last: bool = True,
    par: Parallelism,
) -> tuple[jax.Array, jax.Array]:
    """Output projection and summed cross-entropy.

    Args:
      x: ``[B, T, D]`` final activations (after the last norm), compute dtype.
      w: the output weight, float32: ``[D, V]`` with logical names ``(embed, vocab)`` when
        ``vocab_last``, else ``[V, D]`` with ``(vocab, embed)`` (tied embeddings).
      targets: ``[B, T]`` int32 next tokens.
      weights: ``[B, T]`` float32 loss mask.
      impl: ``auto``, ``gathered`` or ``vocab_parallel`` (`sharding.vocab.OUTPUT_IMPLS`).
      vocab_last: the weight's layout.
      par: the run's layout (`sharding.parallel.Parallelism`).

    Returns:
      ``(loss_sum, weight_sum)`` float32 scalars.

    Raises:
      ValueError: ``vocab_parallel`` where it does not apply (`sharding.vocab.choose_output`).
    """
    vocab, embed = (w.shape[1], w.shape[0]) if vocab_last else w.shape
    split = None
    if par.is_sharded:
        split = choose_for_batch(impl, par.rules, par.auto_shape, vocab, embed, targets.shape)
    if split is None:
        logits = par.constrain(project_logits(x, w, vocab_last), (ax.BATCH, ax.LENGTH, ax.VOCAB))
        return cross_entropy_sums(logits, targets, weights)
    return _vocab_parallel(x, w, targets, weights, split, vocab_last, par)


# Vocabulary-parallel path ----------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _slice_cross_entropy(logits: jax.Array, targets: jax.Array, offset: jax.Array, axes: tuple[str, ...]):
    """Per-token cross-entropy ``[B, T]`` float32 from one vocabulary slice of the logits ``[B, T, Vs]``.

    The logits may be in the compute dtype (bfloat16); the softmax is computed in float32 and
    the gradient returned in the logits' dtype, fused into one elementwise pass.

    The slice holds token ids ``offset .. offset + Vs - 1``; the softmax max, sum and the target
    logit are combined over the slices with ``pmax`` / ``psum`` over ``axes`` (Shoeybi et al.,
    2019, section 3). The gradient, ``softmax - onehot(target)``, needs no collective.
    """
    return _slice_cross_entropy_fwd(logits, targets, offset, axes)[0]


def _slice_cross_entropy_fwd(logits, targets, offset, axes):
    size = logits.shape[-1]
    local = targets - offset
    inside = (local >= 0) & (local < size)
    peak = jax.lax.pmax(jnp.max(logits, axis=-1).astype(jnp.float32), axes)
    total = jax.lax.psum(jnp.sum(jnp.exp(logits.astype(jnp.float32) - peak[..., None]), axis=-1), axes)
    picked = jnp.take_along_axis(logits, jnp.clip(local, 0, size - 1)[..., None], axis=-1)[..., 0]
    target_logit = jax.lax.psum(jnp.where(inside, picked.astype(jnp.float32), 0.0), axes)
    log_norm = peak + jnp.log(total)
    return log_norm - target_logit, (logits, log_norm, jnp.where(inside, local, -1))


def _slice_cross_entropy_bwd(axes, residuals, g):
    logits, log_norm, local = residuals
    column = jax.lax.broadcasted_iota(jnp.int32, logits.shape, logits.ndim - 1)
    onehot = (column == local[..., None]).astype(jnp.float32)
    probs = jnp.exp(logits.astype(jnp.float32) - log_norm[..., None])
    return ((probs - onehot) * g[..., None]).astype(logits.dtype), None, None


_slice_cross_entropy.defvjp(_slice_cross_entropy_fwd, _slice_cross_entropy_bwd)


def _linear_index(axes: tuple[str, ...], sizes) -> jax.Array:
    index = jnp.zeros((), jnp.int32)
    for axis in axes:
        index = index * sizes[axis] + jax.lax.axis_index(axis)
    return index


def _vocab_parallel(x, w, targets, weights, split: VocabSplit, vocab_last: bool, par: Parallelism):
    """The vocabulary-parallel loss under `jax.shard_map` (see the module docstring).

    Per device, with f the group size and t the vocabulary axes' size: the weight shard
    ``[D/f, V/t]`` becomes the slice ``[D, V/(t f)]`` by an all-to-all over the group; the
    activations ``[b, T, D]`` and targets of the group are gathered (``[f b, T, ...]``); the
    logits ``[f b T, V/(t f)]`` give each token's loss after one ``pmax`` and two ``psum`` of
    ``[f b T]`` over the slices; each device then sums its own rows' losses, and one ``psum``
    over the token axes gives the batch's sums. The backward pass: the reverse all-to-all for the
    weight's gradient, a reduce-scatter for the activations'.
    """
    mesh, rules = par.mesh, par.rules
    sizes = par.auto_shape
    tok_spec, _ = logical_to_spec((ax.BATCH, ax.LENGTH), rules, targets.shape, sizes)
    x_spec = PartitionSpec(*tok_spec, None) if len(tok_spec) else PartitionSpec()
    names = (ax.EMBED, ax.VOCAB) if vocab_last else (ax.VOCAB, ax.EMBED)
    w_spec, _ = logical_to_spec(names, rules, w.shape, sizes)
    token_axes = tuple(
        a for entry in tok_spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)
    )
    group, slices = split.group_axes, split.vocab_axes + split.group_axes
    replicated = tuple(a for a in slices if a not in token_axes)  # the activations are whole along these
    unsplit = tuple(a for a in token_axes if a not in slices)  # the weight is whole along these
    embed_dim, vocab_dim = (0, 1) if vocab_last else (1, 0)

    dtype = x.dtype

    def local(x, w, targets, weights):
        # [D/f, V/t] -> [D, V/(t f)]: trade weight shards for a vocabulary slice within the group.
        w = jax.lax.all_to_all(w, group, vocab_dim, embed_dim, tiled=True)
        if unsplit:  # whole along the other token axes: its gradient is summed over them (a psum)
            w = jax.lax.pcast(w, unsplit, to="varying")
        rows = x.shape[0]
        # Each slice's product contributes a partial input gradient. Typed varying over every slice
        # axis, the transposes reduce it: a reduce-scatter over the group (float32), then a psum of
        # the local rows over the vocabulary axes.
        x = x.astype(jnp.float32)
        if replicated:
            x = jax.lax.pcast(x, replicated, to="varying")
        x_all = jax.lax.all_gather(x, group, axis=0, tiled=True).astype(dtype)
        t_all = jax.lax.all_gather(targets, group, axis=0, tiled=True)
        # The slice as [V/(t f), D] (a small transpose when stored [D, V]) makes the weight's
        # gradient come out [V/(t f), D] from [V, tokens] x [tokens, D], a product layout every
        # backend runs fast.
        rows_first = jnp.transpose(w) if vocab_last else w
        logits = jnp.einsum("BTD,VD->BTV", x_all, rows_first.astype(dtype))
        offset = _linear_index(slices, sizes) * logits.shape[-1]
        losses = _slice_cross_entropy(logits, t_all, offset, slices)
        mine = jax.lax.dynamic_slice_in_dim(losses, _linear_index(group, sizes) * rows, rows)
        loss_sum = jax.lax.psum(jnp.sum(mine * weights), token_axes)
        return loss_sum, jax.lax.psum(jnp.sum(weights), token_axes)

    run = jax.shard_map(
        local, mesh=mesh, in_specs=(x_spec, w_spec, tok_spec, tok_spec), out_specs=(PartitionSpec(), PartitionSpec())
    )
    return run(x, w, targets, weights)
