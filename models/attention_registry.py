"""The attention kernels ``ModelConfig.attention`` can name: one `AttentionKernel` record each.

Every module that needs to know about a kernel asks its record: config validation and the
``--attention`` choices (its name), the model (`models.attention.attend` runs the record's
wrapper and checks the context layout against it), the cost model and the planner (its
`sharding.modeldesc.AttentionTraits`, which `models.spec.describe` hands them) and the run report.
No module chooses by a kernel's name.

Adding a kernel: its file under ``models/kernels/`` (importing nothing of ours), one record in
`KERNELS`, and its wrapper in `models.attention_kernels`, ``run_<name>`` with the signature ``(q [B, T, N, H],
k [B, S, K, H], v, segment_ids [B, T] | None, *, causal, layout, par) -> [B, T, N, H]`` in q's dtype,
bound to the record by the decorator ``@_wraps("<name>")``, after which the record holds it (most are a few lines around
`models.attention_kernels`' ``_sharded``, which runs a per-device kernel under ``shard_map`` with specs from
the rules).

This module holds data only and imports no JAX, so that `models.config` and `models.spec` (which
read it) stay free of JAX; the wrappers, which need JAX, are bound to the records where they are
defined (`sharding.bound.BindsRun`), and `models.attention_kernels` checks on import that every record has one.
"""

from __future__ import annotations

import dataclasses

from sharding import exchange
from sharding.bound import BindsRun
from sharding.modeldesc import AttentionTraits
from sharding.parallel import CONTIGUOUS, ZIGZAG

__all__ = ["KERNELS", "AttentionKernel", "accepting", "kernel", "names"]


@dataclasses.dataclass(frozen=True)
class AttentionKernel(BindsRun):
    """One attention implementation, holding its wrapper once `models.attention_kernels` has bound it
    (`sharding.bound.BindsRun`: ``record.run``, ``(q, k, v, segment_ids, *, causal, layout, par) -> out``).

    Attributes:
      traits: What it costs and how it splits (`sharding.modeldesc.AttentionTraits`); its ``name`` is
        the kernel's.
      summary: One line saying what it is (for documentation and messages).
      layouts: The context layouts it accepts (`sharding.parallel.CONTIGUOUS` is natural order;
        `sharding.parallel.ZIGZAG` the balanced causal layout of ring attention).
      auto_layout: The layout ``--context-layout auto`` picks for it when the length is split (P > 1).
      platforms: The platforms it runs on (``cuda``: NVIDIA GPUs), checked against the devices at start-up;
        empty: every platform (the Pallas kernels run interpreted on CPU).
      dtypes: The compute dtypes (``ModelConfig.dtype``) it takes; empty: every one.
      head_dim_multiple: ``head_dim`` must be a multiple of it.
      max_head_dim: The largest ``head_dim`` it takes; 0: no limit.

    Raises:
      ValueError: On an ``auto_layout`` it does not accept.
    """

    what = "attention"
    bound_in = "models.attention_kernels"

    traits: AttentionTraits
    summary: str
    layouts: tuple[str, ...] = (CONTIGUOUS,)
    auto_layout: str = CONTIGUOUS
    platforms: tuple[str, ...] = ()
    dtypes: tuple[str, ...] = ()
    head_dim_multiple: int = 1
    max_head_dim: int = 0

    def __post_init__(self):
        if self.auto_layout not in self.layouts:
            raise ValueError(f"attention {self.name}: auto_layout {self.auto_layout!r} is not one of its layouts")

    @property
    def name(self) -> str:
        """What ``ModelConfig.attention`` (``--attention``) calls it."""
        return self.traits.name

    @property
    def splits_heads(self) -> bool:
        """Whether it trades the length split for a head split over the length's devices (all-to-all or USP
        attention: its exchange's ``all_to_all``), so query heads per device must divide by the all-to-all's
        devices (KV heads are repeated up to them)."""
        return self.traits.exchange.all_to_all

    @property
    def inner_all_to_all(self) -> bool:
        """Whether its all-to-all runs over the innermost mesh axis of the length's split only (``sequence``,
        inside a host) and a ring over the others (``context``): USP, whose exchange does both. The context
        layout's chunks are then dealt over the ring's devices, not all of the length's."""
        return self.traits.exchange.ring and self.traits.exchange.all_to_all


# Our FlashAttention-2 kernels' costs (Dao 2023): no score matrix, the causally empty tiles skipped, and a
# backward of seven products against the forward's two: its dq kernel and its dk/dv kernel each recompute
# the scores and the probabilities' gradient (3 + 4 products; FlashAttention-2's fused backward does 5).
_TILED = {"materialises_scores": False, "key_fraction": 0.5, "training_factor": 4.5}

KERNELS: tuple[AttentionKernel, ...] = (
    AttentionKernel(
        AttentionTraits("flash", **_TILED, under_shard_map=True),
        "our Pallas FlashAttention-2 kernel per device under shard_map: batch and heads split, length "
        "whole; memory linear in length",
    ),
    AttentionKernel(
        # Its custom backward recomputes the probabilities from the rows' log-sum-exp (`reference_attention`).
        AttentionTraits("reference", materialises_scores=True, backward_scores=2),
        "einsum + mask + float32 softmax; GSPMD partitions it; memory O(T*S) per head",
    ),
    AttentionKernel(
        AttentionTraits(
            "ring",
            **_TILED,
            splits_length=True,
            under_shard_map=True,
            searched=False,
            context_exchange=exchange.RING.name,
        ),
        "ring attention (Liu et al., 2023): the length split over the context and sequence axes, key/value "
        "blocks passed around the ring of those devices",
        layouts=(CONTIGUOUS, ZIGZAG),
        auto_layout=ZIGZAG,
    ),
    AttentionKernel(
        AttentionTraits(
            "ulysses",
            **_TILED,
            splits_length=True,
            under_shard_map=True,
            searched=False,
            context_exchange=exchange.ALL_TO_ALL.name,
        ),
        "all-to-all attention (Jacobs et al., 2023): length-split to head-split and back around flash",
        layouts=(CONTIGUOUS, ZIGZAG),
    ),
    AttentionKernel(
        AttentionTraits(
            "usp",
            **_TILED,
            splits_length=True,
            under_shard_map=True,
            searched=False,
            context_exchange=exchange.USP.name,
        ),
        "USP (Fang & Zhao, 2024): all-to-all over sequence (inside a host), ring attention over context "
        "(across hosts), flash per block",
        layouts=(CONTIGUOUS, ZIGZAG),
        auto_layout=ZIGZAG,
    ),
    AttentionKernel(
        # Autodiff through XLA's implementation saves the probabilities and holds four score-sized arrays in
        # the backward (as the reference attention did before its own backward): the same work as the
        # reference attention with more memory, so the planner need not try it.
        AttentionTraits("dot_product", materialises_scores=True, saves_scores=True, backward_scores=4, searched=False),
        "jax.nn.dot_product_attention (JAX's own implementation, a baseline for flash); GSPMD partitions it",
    ),
    AttentionKernel(
        # cuDNN's fused flash attention: no score matrix, the causally masked tiles skipped, a fused backward
        # (FlashAttention-2's five products, recomputing the scores). NVIDIA GPUs and 16-bit inputs only, so the
        # planner does not try it; run per device under shard_map like flash (batch and heads split).
        AttentionTraits(
            "cudnn",
            materialises_scores=False,
            key_fraction=0.5,
            training_factor=3.5,
            under_shard_map=True,
            searched=False,
        ),
        "cuDNN's fused flash attention through jax.nn.dot_product_attention(implementation='cudnn'); NVIDIA "
        "GPUs, bfloat16; per device under shard_map",
        platforms=("cuda",),
        dtypes=("bfloat16",),
        head_dim_multiple=8,
        max_head_dim=256,
    ),
)
"""Every kernel, in the order ``--attention`` lists them and the planner tries them (flash before
reference: of two plans with the same predicted step time the first found is kept)."""


def names() -> tuple[str, ...]:
    """The kernels' names, in `KERNELS` order."""
    return tuple(k.name for k in KERNELS)


def kernel(name: str) -> AttentionKernel:
    """The record of the kernel called ``name``.

    Raises:
      ValueError: When there is none, naming the field and every kernel (``attention 'x': choose one
        of reference, flash, ...``).
    """
    for record in KERNELS:
        if record.name == name:
            return record
    raise ValueError(f"attention {name!r}: choose one of {', '.join(names())}")


def accepting(layout: str) -> tuple[str, ...]:
    """The names of the kernels that accept tokens in ``layout``."""
    return tuple(k.name for k in KERNELS if layout in k.layouts)
