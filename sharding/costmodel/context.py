"""Collective bytes of context-parallel attention: ring, all-to-all (Ulysses) and USP.

What one device of a length split over R x U devices sends and receives for one attention call, by
the HLO op that carries it, as the kernels issue it (`models/kernels/`): the cost model's term for the
traffic of a kernel whose traits name a ``context_exchange``. Per device, with L tokens, N query heads,
K KV heads (per ``tensor`` shard), H head_dim, b bytes an element, B sequences:

* all-to-all over U (Jacobs et al., 2023): KV heads repeated to K' = lcm(K, U) (r = U / gcd(K, U)), one
  all-to-all each for q, k, v and the output, ``B L/(R U) (2 N + 2 K') H b`` bytes of operands forward;
  the backward's transposes move the same again.
* ring over R (Liu et al., 2023): R - 1 hops of the key and value block (``B L/R K'/U H`` elements each,
  K'/U = K when U = 1) and its segment ids (4 bytes a token) forward; backward, the key/value block
  again (its first hop is the forward's, reused when both are in one program, not across the
  forward and backward bodies of a scanned layer stack) and R - 1 hops of their float32 gradients.
* USP (Fang & Zhao, 2024): both, the ring on the all-to-all's output.

Bytes are per-device results of the collectives (`sharding.hlo.collectives`: an all-to-all's operand
size, a collective-permute's block), the quantity the test compares with the compiled program.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from sharding.modeldesc import AttentionTraits


def context_groups(
    traits: AttentionTraits, mesh: Mapping[str, int], length_axes: Sequence[str]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The mesh axes of the ring and of the all-to-all of a context-parallel kernel on ``mesh``.

    Ring attention passes blocks around every device of the length (``length_axes``: ``context`` x
    ``sequence`` under every preset, one ring); all-to-all attention trades heads over all of them; USP
    runs the all-to-all over the innermost length axis (``sequence``, inside a host) and the ring over the
    others (``context``) (`sharding.exchange.ContextExchange.groups`). Axes of size 1 are left out.

    Args:
      traits: The kernel's (its ``context_exchange``).
      mesh: Mesh axis -> size (missing axes are 1).
      length_axes: The mesh axes the rules map ``length`` to, outermost first
        (``rules.mesh_axes(sharding.axes.LENGTH)``), as the kernel's `jax.shard_map` reads them.

    Returns:
      ``(ring_axes, all_to_all_axes)``; both empty for a kernel that does not split the length.
    """
    return traits.exchange.groups(mesh, length_axes)


def context_traffic(
    traits: AttentionTraits,
    *,
    batch: int,
    length: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    ring: int,
    all_to_all: int,
    act_bytes: int,
    segment_ids: bool = False,
    training: bool = False,
    first_hop_reused: bool = True,
) -> dict[str, float]:
    """Bytes per device of the collectives one context-parallel attention call issues, by HLO op.

    Args:
      traits: The kernel's (its ``context_exchange``: ``ring``, ``all_to_all`` or ``usp``).
      batch: B, sequences on the device (after the batch split).
      length: L, tokens per sequence (whole).
      heads, kv_heads: N, K per device before the exchange (after any ``tensor`` split).
      head_dim: H.
      ring: R, devices of the ring (1 for ``all_to_all``).
      all_to_all: U, devices of the all-to-all (1 for ``ring``).
      act_bytes: Bytes of an element of q, k, v (2 for bfloat16, 4 for float32).
      segment_ids: Whether packed-document ids travel with the keys.
      training: Forward and backward (True) or the forward alone.
      first_hop_reused: Whether the backward's first key/value hop is the forward's (one attention
        differentiated in one program: XLA merges the two); False inside a scanned layer stack, whose
        backward loop body sends it again.

    Returns:
      ``{"all-to-all": bytes, "collective-permute": bytes}`` (absent ops omitted).

    Raises:
      ValueError: A kernel without a ``context_exchange``, an exchange of the wrong shape (a ring for
        ``all_to_all``, an all-to-all for ``ring``), or query heads U does not divide.
    """
    exchange = traits.exchange
    if not (exchange.ring or exchange.all_to_all):
        raise ValueError(f"attention {traits.name!r} does not split the length; it has no context traffic")
    if (not exchange.all_to_all and all_to_all != 1) or (not exchange.ring and ring != 1):
        raise ValueError(f"attention {traits.name!r} ({exchange.name}) over ring={ring} x all_to_all={all_to_all}")
    if heads % all_to_all:
        raise ValueError(f"attention {traits.name!r}: {heads} heads do not split over {all_to_all} devices")
    local = batch * length / (ring * all_to_all)  # tokens on the device
    found: dict[str, float] = {}
    kv_exchanged = kv_heads * all_to_all // math.gcd(kv_heads, all_to_all)  # lcm(K, U)
    if all_to_all > 1:
        forward = local * (2 * heads + 2 * kv_exchanged) * head_dim * act_bytes
        found["all-to-all"] = forward * (2 if training else 1)
    if ring > 1:
        block = batch * length / ring  # tokens a ring member's block holds
        kv_block = 2 * block * (kv_exchanged // all_to_all) * head_dim
        ids = block * 4 if segment_ids else 0
        hops = ring - 1
        permute = hops * (kv_block * act_bytes + ids)
        if training:
            resent = hops - 1 if first_hop_reused else hops
            permute += resent * (kv_block * act_bytes + ids) + hops * kv_block * 4
        found["collective-permute"] = permute
    return found


__all__ = ["context_groups", "context_traffic"]
