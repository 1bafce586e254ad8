"""The flash attention kernels' tile sizes and their validation: `BlockSizes`, the static description of one
call (``_Config``) and the checks that turn bad inputs into readable errors.

Part of `models.kernels.flash_attention` (FlashAttention-2, Dao 2023), which holds the public functions;
the kernels that read ``_Config`` are in `models.kernels.flash_kernels`.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

# Running-max floor. Masked scores are -inf and the running max starts at this finite value,
# so exp(score - max) is exactly 0 for masked scores and never exp(-inf - -inf) = NaN.
_MAX_FLOOR = -1e30
# Smallest tile edge: Triton's tensor-core dots need M, N, K >= 16.
_MIN_BLOCK = 16
_SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


def _round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes of the three kernels, in tokens.

    Each must be a power of two and at least 16 (the Triton GPU lowering needs power-of-two
    tensor shapes and tensor-core dots of at least 16 x 16). A block larger than the
    (power-of-two rounded) sequence is clamped down to it, so short sequences are not padded
    to a full block. The field defaults are tuned for bfloat16 on an H200 (head_dim 128,
    causal); `BlockSizes.default_for(dtype)` is what `flash_attention` uses when given none.

    Attributes:
      block_q: query rows per forward program.
      block_kv: keys per forward inner-loop step.
      block_q_dq: query rows per dq program.
      block_kv_dq: keys per dq inner-loop step.
      block_q_dkv: query rows per dk/dv inner-loop step.
      block_kv_dkv: keys per dk/dv program.

    Raises:
      ValueError: at construction, naming the field, if a size is not an int, is not a power
        of two, or is below 16.
    """

    block_q: int = 128
    block_kv: int = 128
    block_q_dq: int = 64
    block_kv_dq: int = 64
    block_q_dkv: int = 64
    block_kv_dkv: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"BlockSizes.{field.name} must be an int, got {value!r} ({type(value).__name__}).")
            if value < _MIN_BLOCK or not _is_power_of_two(value):
                raise ValueError(
                    f"BlockSizes.{field.name} must be a power of two >= {_MIN_BLOCK} "
                    f"(the GPU lowering needs power-of-two tiles of at least 16), got {value}."
                )

    @classmethod
    def default_for(cls, dtype) -> BlockSizes:
        """Default tiles for an input dtype `dtype`.

        bfloat16: the field defaults. float32: 64 x 64 forward tiles too, since float32 tiles
        take twice the registers and shared memory of bfloat16 ones and Triton compiles the
        full-precision (non-tensor-core) float32 dots slowly at larger tiles.
        """
        if jnp.dtype(dtype) == jnp.float32:
            return cls(block_q=64, block_kv=64)
        return cls()


@dataclasses.dataclass(frozen=True)
class _Config:
    """Static (hashable) description of one attention call, after padding and clamping."""

    causal: bool
    sm_scale: float
    q_length: int  # T, real.
    kv_length: int  # S, real.
    q_padded: int  # T rounded up to every query block.
    kv_padded: int  # S rounded up to every key block.
    groups: int  # G = N // K.
    has_segments: bool
    block_q: int
    block_kv: int
    block_q_dq: int
    block_kv_dq: int
    block_q_dkv: int
    block_kv_dkv: int
    interpret: bool | None  # None: by the platform lowered for (`flash_kernels._pallas_call`).
    count_tiles: bool = False  # Debug: also return the number of tiles each program computed.
    # Valid lengths given at run time (`[2]` int32: real query rows, real keys): rows and keys at or past
    # them are padding, masked in every tile, and tiles holding only padding are not computed.
    has_lengths: bool = False

    def input_count(self, arrays: int) -> int:
        """Kernel inputs: ``arrays`` tensors, then segment ids and valid lengths where present."""
        return arrays + 2 * self.has_segments + 2 * self.has_lengths

    @property
    def causal_offset(self) -> int:
        """Query i may attend key j iff j <= i + causal_offset (last query sees last key)."""
        return self.kv_length - self.q_length

    @property
    def mask_kv_padding(self) -> bool:
        """Whether padded keys need masking. Causal masking already hides them from every
        real query row (j > i + S - T >= S for j >= S), so only non-causal calls need it."""
        return self.kv_padded != self.kv_length and not self.causal


# --------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------


_EXPECTED_LAYOUT = {
    "q": "[batch, q_length, heads, head_dim]",
    "k": "[batch, kv_length, kv_heads, head_dim]",
    "v": "[batch, kv_length, kv_heads, head_dim]",
}


def _check_arrays(q, k, v) -> None:
    """Raises ValueError unless q, k, v have fitting ranks, shapes and dtypes."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        if x.ndim != 4:
            raise ValueError(f"{name} must have rank 4 {_EXPECTED_LAYOUT[name]}, got shape {tuple(x.shape)}.")
        if jnp.dtype(x.dtype) not in _SUPPORTED_DTYPES:
            raise ValueError(f"{name} must be float32 or bfloat16, got {x.dtype}.")
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}.")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype} and {v.dtype}.")
    batch, q_length, heads, head_dim = q.shape
    kv_batch, kv_length, kv_heads, kv_head_dim = k.shape
    if kv_batch != batch:
        raise ValueError(f"q and k must have the same batch size, got {batch} and {kv_batch}.")
    if kv_head_dim != head_dim:
        raise ValueError(f"q and k must have the same head_dim, got {head_dim} and {kv_head_dim}.")
    if min(q_length, kv_length, heads, kv_heads, head_dim) < 1:
        raise ValueError(f"Empty dimension: q shape {tuple(q.shape)}, k shape {tuple(k.shape)}.")
    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads}) for grouped-query attention.")


def _check_segment_ids(q_segment_ids, kv_segment_ids, batch, q_length, kv_length) -> None:
    """Raises ValueError unless both or neither are given, integer, `[batch, length]`."""
    if (q_segment_ids is None) != (kv_segment_ids is None):
        given, missing = "q_segment_ids", "kv_segment_ids"
        if q_segment_ids is None:
            given, missing = missing, given
        raise ValueError(f"{given} was given without {missing}: pass both or neither.")
    if q_segment_ids is None:
        return
    for name, ids, length in (
        ("q_segment_ids", q_segment_ids, q_length),
        ("kv_segment_ids", kv_segment_ids, kv_length),
    ):
        if tuple(ids.shape) != (batch, length):
            raise ValueError(f"{name} must have shape [batch, length] = {(batch, length)}, got {tuple(ids.shape)}.")
        if not jnp.issubdtype(ids.dtype, jnp.integer):
            raise ValueError(f"{name} must be an integer array, got {ids.dtype}.")


def _check_inputs(q, k, v, q_segment_ids, kv_segment_ids) -> None:
    """Raises ValueError with a readable message if the arguments do not fit together."""
    _check_arrays(q, k, v)
    _check_segment_ids(q_segment_ids, kv_segment_ids, q.shape[0], q.shape[1], k.shape[1])


def _clamp_block(block: int, length: int) -> int:
    """Shrinks a block to the power-of-two rounded length (at least 16)."""
    return min(block, max(_MIN_BLOCK, _next_power_of_two(length)))


def _make_config(
    q, k, *, causal, sm_scale, block_sizes, interpret, has_segments, count_tiles=False, has_lengths=False
) -> _Config:
    q_length, kv_length = q.shape[1], k.shape[1]
    qb = {f: _clamp_block(getattr(block_sizes, f), q_length) for f in ("block_q", "block_q_dq", "block_q_dkv")}
    kb = {f: _clamp_block(getattr(block_sizes, f), kv_length) for f in ("block_kv", "block_kv_dq", "block_kv_dkv")}
    return _Config(
        causal=bool(causal),
        sm_scale=float(sm_scale),
        q_length=q_length,
        kv_length=kv_length,
        # Block sizes are powers of two, so the largest is a multiple of the others.
        q_padded=_round_up(q_length, max(qb.values())),
        kv_padded=_round_up(kv_length, max(kb.values())),
        groups=q.shape[2] // k.shape[2],
        has_segments=has_segments,
        interpret=None if interpret is None else bool(interpret),
        count_tiles=count_tiles,
        has_lengths=has_lengths,
        **qb,
        **kb,
    )
