"""Where the output projection and the cross-entropy run vocabulary-parallel.

The loss reduces the logits ``[tokens, vocab]`` over the vocabulary, so the output projection
can be split two ways when its weight ``[embed, vocab]`` is split over the axes that also split
the batch (FSDP):

``gathered``
    The partitioner's way: every device gathers the whole weight and computes its own tokens'
    logits; the weight's gradient is reduce-scattered back (an all-reduce of the whole gradient
    on XLA's CPU backend). Per device and step it moves about ``2 x D x V/t`` float32 values.
``vocab_parallel``
    Megatron-LM's vocabulary-parallel cross-entropy (Shoeybi et al., "Megatron-LM", 2019,
    section 3, the output embedding), over the axes that split the weight's ``embed`` dimension
    (the *group*, of size f): the devices of a group trade weight shards for vocabulary slices
    (an all-to-all moving ``(f-1)/f`` of the local shard), gather the group's activations
    ``[f x tokens, D]``, and each computes the logits of all those tokens over its slice; the
    softmax max, sum and target logit are combined across slices with collectives on
    ``[tokens]`` vectors. The backward pass returns the slice gradient by the reverse all-to-all
    and reduce-scatters the activations' gradient. Nothing ever holds the whole weight.
``auto``
    ``vocab_parallel`` where it applies (`vocab_split`) and moves fewer bytes per device
    (`output_traffic`): roughly while the group's tokens per step are fewer than twice the
    vocabulary slice held per device, e.g. short sequences or small per-device batches with a
    large vocabulary; otherwise ``gathered``.

Pure arithmetic on the rules and mesh sizes (no arrays): `models.output` calls `choose_output`
while a step is traced, the cost model (`sharding.costmodel`) calls it to predict the collectives.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping

from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.rules import Rules, logical_to_spec

OUTPUT_IMPLS = ("auto", "gathered", "vocab_parallel")
"""Values of ``ModelConfig.logits`` (``--logits``)."""

_PARAM_BYTES = 4  # the weight and its gradient are float32
_ACTIVATION_BYTES = 4  # activations are gathered (and their gradient reduced) in float32
_TARGET_BYTES = 4  # int32 targets gathered with the activations


@dataclasses.dataclass(frozen=True)
class VocabSplit:
    """How the vocabulary-parallel loss splits the work.

    Attributes:
      group_axes: mesh axes splitting the weight's ``embed`` dimension (and the batch): the
        devices of a group exchange weight shards and gather each other's tokens over them.
      vocab_axes: mesh axes splitting the weight's ``vocab`` dimension as stored (``tensor``).
      group: f, devices per group (product of ``group_axes`` sizes).
      shards: vocabulary slices in all (``group`` x the ``vocab_axes`` sizes); slice
        ``vocab_index * group + group_index`` is held by the device with those indices.
    """

    group_axes: tuple[str, ...]
    vocab_axes: tuple[str, ...]
    group: int
    shards: int


def _axes_of(spec, dim: int) -> tuple[str, ...]:
    entry = spec[dim] if len(spec) > dim else None
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def vocab_split(
    rules: Rules, mesh_shape: Mapping[str, int], vocab_size: int, embed_dim: int, rows: int
) -> tuple[VocabSplit | None, str]:
    """The vocabulary-parallel split for these rules and mesh, or why there is none.

    Args:
      rules: logical-to-mesh rules.
      mesh_shape: mesh axis -> size.
      vocab_size: V.
      embed_dim: D.
      rows: global batch rows of the activations ``[rows, length, D]`` that enter the loss.

    Returns:
      ``(split, "")`` or ``(None, reason)``.
    """
    if mesh_shape.get(ax.STAGE, 1) > 1:
        return None, "pipeline stages (a stage axis) run the output projection with its weight gathered"
    spec, _ = logical_to_spec((ax.EMBED, ax.VOCAB), rules, (embed_dim, vocab_size), mesh_shape)
    group_axes, vocab_axes = _axes_of(spec, 0), _axes_of(spec, 1)
    if not group_axes:
        return None, "the output weight's embed dimension is not split"
    batch_spec, _ = logical_to_spec((ax.BATCH,), rules, (rows,), mesh_shape)
    batch_axes = _axes_of(batch_spec, 0)
    if not set(group_axes) <= set(batch_axes):
        return None, (
            f"the output weight's embed dimension is split over {'+'.join(group_axes)}, which does not "
            f"split the batch ({'+'.join(batch_axes) or 'whole'})"
        )
    group = math.prod(mesh_shape[a] for a in group_axes)
    shards = group * math.prod(mesh_shape[a] for a in vocab_axes)
    if vocab_size % shards:
        return None, f"vocab_size {vocab_size} is not divisible into {shards} slices"
    return VocabSplit(group_axes, vocab_axes, group, shards), ""


def output_traffic(split: VocabSplit, vocab_size: int, embed_dim: int, tokens: float) -> tuple[float, float]:
    """Bytes each device sends per forward and backward pass: ``(gathered, vocab_parallel)``.

    Ring collectives move ``(n-1)/n`` of the gathered or reduced array per device.

    Args:
      split: the split (`vocab_split`).
      vocab_size: V.
      embed_dim: D.
      tokens: tokens of the loss on one device (per microbatch).
    """
    f = split.group
    shard = embed_dim * vocab_size / (split.shards / f) * _PARAM_BYTES  # the weight over the vocab axes: D x V/t
    gathered = 2 * shard * (f - 1) / f  # all-gather, then reduce-scatter of the gradient
    group_tokens = tokens * f
    activations = group_tokens * (embed_dim * _ACTIVATION_BYTES * 2 + _TARGET_BYTES) * (f - 1) / f
    exchange = 2 * shard / f * (f - 1) / f  # all-to-all of the local shard, and back
    return gathered, activations + exchange


def choose_output(
    impl: str, rules: Rules, mesh_shape: Mapping[str, int], vocab_size: int, embed_dim: int, rows: int, tokens: float
) -> VocabSplit | None:
    """The split the loss uses, or None for ``gathered``.

    Args:
      impl: ``auto``, ``gathered`` or ``vocab_parallel`` (`OUTPUT_IMPLS`).
      rules, mesh_shape, vocab_size, embed_dim, rows: as `vocab_split`.
      tokens: tokens of the loss on one device (per microbatch).

    Raises:
      ValueError: an unknown ``impl``, or ``vocab_parallel`` where it does not apply (with the reason).
    """
    if impl not in OUTPUT_IMPLS:
        raise ConfigError(Field("logits", repr(impl)), f": choose one of {', '.join(OUTPUT_IMPLS)}")
    if impl == "gathered":
        return None
    split, reason = vocab_split(rules, mesh_shape, vocab_size, embed_dim, rows)
    if split is None:
        if impl == "vocab_parallel":
            raise ConfigError(
                Field("logits", "vocab_parallel"),
                f" does not apply here: {reason}; use ",
                Field("logits", "auto"),
                " or gathered",
            )
        return None
    if impl == "auto":
        gathered, parallel = output_traffic(split, vocab_size, embed_dim, tokens)
        return split if parallel < gathered else None
    return split


def choose_for_batch(
    impl: str,
    rules: Rules,
    mesh_shape: Mapping[str, int],
    vocab_size: int,
    embed_dim: int,
    batch_shape: tuple[int, int],
) -> VocabSplit | None:
    """`choose_output` for a ``[batch, length]`` batch laid out by the rules (tokens per device from its spec).

    Raises:
      ValueError: as `choose_output`.
    """
    return choose_output(
        impl,
        rules,
        mesh_shape,
        vocab_size,
        embed_dim,
        batch_shape[0],
        tokens_per_device(rules, mesh_shape, batch_shape),
    )


def lookup_gathers_table(
    rules: Rules, mesh_shape: Mapping[str, int], vocab_size: int, embed_dim: int, rows: int
) -> bool:
    """Whether the token embedding lookup reads its table ``[vocab, embed]`` with ``embed`` whole.

    Looked up from a table whose ``embed`` dimension is split (over ``fsdp``), the rows come out split along
    ``embed``. While the batch is split over those same axes only, the partitioner moves the rows to the
    activations' batch split with one all-to-all (`sharding.costmodel.embedding`). When the batch is also split
    over an axis that ``embed`` is not (``data``), XLA's partitioner finds no such move: it gathers the whole
    batch's activations onto every device, and in the backward pass their gradient (it warns of an
    "involuntary full rematerialization"). There the lookup reads the table laid out as the activations'
    embedding (``act_embed``: gathered over the axes that split ``embed``, as FSDP gathers every weight before
    use; a ``vocab`` split stays) and its gradient is summed back over the batch axes.

    Args:
      rules: logical-to-mesh rules.
      mesh_shape: mesh axis -> size (the axes annotations may use).
      vocab_size: V.
      embed_dim: D.
      rows: global batch rows of the tokens ``[rows, length]`` looked up.

    Returns:
      True where the table's ``embed`` is split and the batch is split over some other axis too.
    """
    table, _ = logical_to_spec((ax.VOCAB, ax.EMBED), rules, (vocab_size, embed_dim), mesh_shape)
    batch, _ = logical_to_spec((ax.BATCH,), rules, (rows,), mesh_shape)
    embed_axes, batch_axes = set(_axes_of(table, 1)), set(_axes_of(batch, 0))
    return bool(embed_axes) and bool(batch_axes - embed_axes)


def tokens_per_device(rules: Rules, mesh_shape: Mapping[str, int], batch_shape: tuple[int, int]) -> float:
    """Tokens of a ``[batch, length]`` batch on one device, as the rules lay it out."""
    spec, _ = logical_to_spec((ax.BATCH, ax.LENGTH), rules, batch_shape, mesh_shape)
    split = math.prod(
        mesh_shape[a] for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)
    )
    return batch_shape[0] * batch_shape[1] / split
