"""Pallas and shard_map kernels, and the wrapper of cuDNN's fused attention. Import nothing from the rest of meshwork."""

from .cudnn_attention import cudnn_attention
from .flash_attention import (
    flash_attention,
    flash_attention_backward,
    flash_attention_forward,
    flash_attention_reference,
)
from .flash_blocks import BlockSizes
from .ring_attention import ring_attention, zigzag_permutation
from .ulysses_attention import ulysses_attention
from .usp_attention import usp_attention

__all__ = [
    "BlockSizes",
    "cudnn_attention",
    "flash_attention",
    "flash_attention_backward",
    "flash_attention_forward",
    "flash_attention_reference",
    "ring_attention",
    "ulysses_attention",
    "usp_attention",
    "zigzag_permutation",
]
