"""Pallas and shard_map kernels. Import nothing from the rest of meshwork."""

from .flash_attention import (
    BlockSizes,
    flash_attention,
    flash_attention_reference,
)

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]
