"""Packing: windows of the token stream into the fields a step reads (tokens, targets, positions, segment ids,
loss mask), and their order along the length for a context-parallel layout.
"""

from __future__ import annotations

import numpy as np

FIELDS = ("tokens", "targets", "positions", "segment_ids", "loss_mask")


def model_inputs(batch) -> tuple:
    """A batch's arrays in the order the model's loss functions take them (`models.transformer.loss_sums`,
    `loss_terms`): ``tokens``, ``targets``, ``loss_mask``, ``positions``, ``segment_ids``, each ``[batch,
    length]`` (int32; the mask float32)."""
    return tuple(batch[k] for k in ("tokens", "targets", "loss_mask", "positions", "segment_ids"))


def pack_windows(windows: np.ndarray, eod_id: int, mask: np.ndarray | None = None) -> dict[str, np.ndarray]:
    """Turns ``[rows, seq_len + 1]`` token windows into model inputs.

    Args:
      windows: ``[rows, seq_len + 1]`` tokens.
      eod_id: the end-of-document token.
      mask: ``[rows, seq_len + 1]`` bool, whether each token is one to learn (chat data: the assistant's); a
        target outside it gets no loss. None: every token.

    Returns:
      ``tokens, targets, positions, segment_ids`` int32 and ``loss_mask`` float32, each ``[rows, seq_len]``,
      as described in the module docstring.
    """
    windows = windows.astype(np.int32)
    tokens, targets = windows[:, :-1], windows[:, 1:]
    is_eod = tokens == eod_id
    # Segment of position i: 1 + number of EODs strictly before i.
    before = np.concatenate([np.zeros_like(is_eod[:, :1]), is_eod[:, :-1]], axis=1)
    segment_ids = 1 + np.cumsum(before, axis=1, dtype=np.int32)
    index = np.broadcast_to(np.arange(tokens.shape[1], dtype=np.int32), tokens.shape)
    starts = np.where(np.concatenate([np.ones_like(before[:, :1]), before[:, 1:]], axis=1), index, 0)
    positions = index - np.maximum.accumulate(starts, axis=1)
    return {
        "tokens": tokens,
        "targets": targets,
        "positions": positions.astype(np.int32),
        "segment_ids": segment_ids.astype(np.int32),
        "loss_mask": ((~is_eod) & (True if mask is None else mask[:, 1:])).astype(np.float32),
    }


def context_permutation(
    seq_len: int, num_shards: int, layout: str, shares: tuple[int, ...] | None = None
) -> np.ndarray | None:
    """The order in which a row's tokens are laid out along the length, for ``--context-layout``.

    Args:
      seq_len: T, tokens per row (``--seq-len``).
      num_shards: P, devices the length is split over (the ``sequence`` axis).
      layout: ``contiguous`` (natural order) or ``zigzag`` (device r holds chunks r and
        2P-1-r of 2P; `models.kernels.ring_attention.zigzag_permutation`).
      shares: uneven shards (``--context-shares``): real tokens per device, which then holds them in
        a block of ``max(shares)`` positions, padded (`models.kernels.ring_attention.uneven_zigzag_layout`).

    Returns:
      int64 indices (``field[:, perm]`` is the laid-out row; ``[seq_len]``, or ``[P * max(shares)]`` with -1
      at padding), or None for the natural order.

    Raises:
      ValueError: an unknown layout, or a ``--seq-len`` not divisible by 2P for zigzag.
    """
    if shares is not None:
        from models.kernels.ring_attention import uneven_zigzag_layout  # slow: jax

        return uneven_zigzag_layout(shares, max(shares))
    if layout == "contiguous":
        return None
    if layout != "zigzag":
        raise ValueError(f"--context-layout {layout!r}: choose contiguous or zigzag")
    from models.kernels.ring_attention import zigzag_permutation  # slow: jax

    try:
        permutation = zigzag_permutation(seq_len, num_shards)
    except ValueError:
        raise ValueError(
            f"--seq-len {seq_len}: --context-layout zigzag needs a multiple of 2 x {num_shards} (the sequence "
            f"axis) = {2 * num_shards}; e.g. --seq-len {max(1, seq_len // (2 * num_shards)) * 2 * num_shards}"
        ) from None
    return None if num_shards == 1 else permutation  # over one device zigzag is the natural order


def permute_length(fields: dict[str, np.ndarray], permutation: np.ndarray | None) -> dict[str, np.ndarray]:
    """Every ``[rows, seq_len]`` field with its columns in ``permutation`` order (None: as is); a column of
    -1 is padding (uneven context shares): 0 in every field, so no loss (``loss_mask`` 0), segment 0 (real
    segments count from 1), and the kernels mask it by position."""
    if permutation is None:
        return fields
    pad = permutation < 0
    take = np.where(pad, 0, permutation)
    out = {}
    for name, value in fields.items():
        laid = value[:, take]
        laid[:, pad] = 0
        out[name] = np.ascontiguousarray(laid)
    return out
