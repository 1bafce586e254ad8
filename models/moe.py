"""Mixture-of-experts feed-forward layer: router, dropless grouped matrix products, expert parallelism.

Einsum letters: B batch, T length, D embed, F mlp (one expert's hidden width), E experts, K experts per
token (top-k), N tokens (flattened ``B*T``), R routed rows (``N*K``, token copies sorted by expert).

A token ``x [D]`` goes to the ``K`` experts with the highest router scores and leaves as the weighted
sum of their SwiGLU outputs (Shazeer et al., "Outrageously Large Neural Networks", 2017; Fedus et al.,
"Switch Transformers", 2021), plus the shared experts' output when there are some (Dai et al.,
DeepSeekMoE, 2024)::

    logits = x @ router                                   # [E], float32
    softmax router:  p = softmax(logits); w, e = top_k(p, K)          (Mixtral, Qwen3-MoE)
    sigmoid router:  p = sigmoid(logits); w, e = top_k(p, K)          (DeepSeek-V3)
    norm_topk:       w = w / sum(w)                                   (Mixtral; Qwen3 norm_topk_prob)
    y = routed_scale * sum_j w_j * expert_{e_j}(x) + shared(x)

Dropless by default: the ``N*K`` token copies are sorted by expert and multiplied with grouped matrix
products (`jax.lax.ragged_dot`: one group of rows per expert), so no token is dropped and no expert
computes padding. With ``capacity_factor`` each expert takes at most
``C = ceil(capacity_factor * N * K / E)`` of the copies one device routes, earlier tokens first; the
rest contribute zero (the token keeps its residual) and are counted (GShard, Lepikhin et al., 2020:
capacity per group of tokens, a group being what one device holds).

Auxiliary losses, each a float32 scalar over the tokens of the call:

* load balancing (Switch Transformers, eq. 4): ``aux = E * sum_e f_e * P_e`` with ``f_e`` the fraction
  of the ``N*K`` routed copies sent to expert ``e`` and ``P_e`` the mean router probability of ``e``
  (sigmoid scores normalised per token); 1.0 when the load is uniform;
* router z-loss (Zoph et al., ST-MoE, 2022, eq. 5): ``mean(logsumexp(logits)^2)``.

Expert parallelism. With the experts split over the ``expert`` mesh axis (the rules map the logical
``expert`` axis there, and the batch over ``data``, ``fsdp`` and ``expert``: attention is data-parallel
over the devices that split the experts), the layer runs per device under `jax.shard_map`: each device
all-gathers the tokens and their routing over ``expert``, runs its own experts over the copies routed to
them, and the partial outputs are summed and scattered back to the devices that hold the tokens with a
reduce-scatter. This is MaxText's "ring of experts" dispatch. It was chosen over the all-to-all for
these reasons: `jax.lax.ragged_all_to_all` does not lower on XLA:CPU (its HLO op is unimplemented
there in JAX 0.10), and a padded all-to-all that stays dropless needs a buffer for the worst case (all
``N*K`` copies of a device going to one device), ``K`` times the all-gather's ``N`` rows per peer; the
ring is exact, dropless and lowers on every backend. With a capacity (``capacity_factor`` > 0) every
device sends each expert a buffer of fixed size, so a plain `jax.lax.all_to_all` carries the dispatch and
the combine (GShard's dispatch): ``2 * cf * N * K * D * (E_p - 1) / E_p`` elements per device and layer
against the ring's ``2 * (E_p - 1) * N * D``; it is used where it moves less (``cf * K < E_p``,
`sharding.dispatch.expert_dispatch`) and drops the same copies as the ring. Each dispatch is a record of
`sharding.dispatch`, which holds the function here that performs it (bound by ``_dispatches``). The expert weights may also
be split over ``fsdp`` (their ``expert_embed``, gathered by the partitioner before the map) and
``tensor`` (their ``mlp``, Megatron-style: partial outputs summed over ``tensor``).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec

from models import lora
from models.config import ModelConfig
from models.layers import MLP, make_params
from models.spec import expert_geometry, moe_params
from sharding import axes as ax
from sharding import dispatch
from sharding.bound import require_bound
from sharding.expert_placement import ExpertPlacement, expert_placement
from sharding.modeldesc import held_copies
from sharding.parallel import Parallelism, spec_entry, to_varying, varying_axes

__all__ = [
    "MoE",
    "capacity",
    "capacity_keep",
    "capacity_slots",
    "expert_outputs",
    "layer_dispatch",
    "layer_placement",
    "route",
    "router_losses",
    "router_objective",
    "stable_argsort",
]


def route(logits: jax.Array, config: ModelConfig) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The router's choices for each token.

    Args:
      logits: ``[..., E]`` float32 router logits.
      config: the model (``router``, ``experts_per_token``, ``norm_topk``, ``routed_scale``).

    Returns:
      ``(weights [..., K] float32, experts [..., K] int32, probs [..., E] float32)``: the combine weights
      of the chosen experts (renormalised when ``norm_topk``, times ``routed_scale``), their indices in
      decreasing score (ties to the lower index, as `jax.lax.top_k`), and the router probabilities the
      balancing loss reads (softmax, or sigmoid scores normalised per token).
    """
    if config.router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    weights, experts = jax.lax.top_k(scores, config.experts_per_token)
    if config.norm_topk:
        weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
    return weights * config.routed_scale, experts.astype(jnp.int32), probs


def router_losses(
    logits: jax.Array, probs: jax.Array, experts: jax.Array, num_experts: int, axes: tuple[str, ...] = ()
) -> dict[str, jax.Array]:
    """The load-balancing loss and the router z-loss (module docstring), float32 scalars.

    Args:
      logits: ``[N, E]`` float32 router logits.
      probs: ``[N, E]`` float32 router probabilities (`route`).
      experts: ``[N, K]`` int32 chosen experts.
      num_experts: E.
      axes: manual mesh axes (inside `jax.shard_map`) that split the tokens of one group: the counts, the
        probabilities and the squared log-partitions are summed over them first, so that every device gets
        the losses of the whole group (a pipeline stage's microbatch); empty: the tokens here are the group.

    Returns:
      ``{"aux": E * sum_e f_e * P_e, "z": mean(logsumexp(logits)^2), "load": [E]}``: ``load`` the routed
      copies each expert received (float32 counts, before any capacity drop; ``N*K`` in all), from which the
      step reports the routing balance.
    """
    k = experts.shape[-1]
    counts = jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32), axis=(0, 1))  # [E]
    prob_sum = jnp.sum(probs, axis=0)  # [E]
    square_sum = jnp.sum(jnp.square(jax.nn.logsumexp(logits, axis=-1)))
    if axes:
        counts, prob_sum, square_sum = jax.lax.psum((counts, prob_sum, square_sum), axes)
    copies = jnp.sum(counts)  # N*K over the group: integers, exact in float32
    tokens = copies / k
    aux = num_experts * jnp.sum(jax.lax.stop_gradient(counts / copies) * (prob_sum / tokens))
    return {"aux": aux, "z": square_sum / tokens, "load": counts}


def router_objective(config: ModelConfig, stats: dict[str, jax.Array], weight_sum: jax.Array) -> jax.Array:
    """What the router losses add to a summed training loss: ``weight_sum * (router_aux_coef * aux +
    router_z_coef * z)`` (float32 scalar), so that dividing by the tokens gives the weighted mean losses."""
    return weight_sum * (config.router_aux_coef * stats["aux"] + config.router_z_coef * stats["z"])


def capacity_keep(experts: jax.Array, num_experts: int, capacity_factor: float) -> jax.Array:
    """Which routed copies fit their expert's capacity, over the tokens of one group.

    Args:
      experts: ``[N, K]`` int32 chosen experts of the group's tokens.
      num_experts: E.
      capacity_factor: > 0; the capacity is ``ceil(capacity_factor * N * K / E)`` copies per expert.

    Returns:
      ``[N, K]`` bool: True for a copy within its expert's capacity (copies of earlier tokens first, and
      of a token's higher-scored choice first).
    """
    return capacity_slots(experts, num_experts, capacity(experts.size, num_experts, capacity_factor)) >= 0


def capacity(copies: int, num_experts: int, capacity_factor: float) -> int:
    """``ceil(capacity_factor * copies / num_experts)``: the routed copies one expert takes from a group
    of ``copies`` (``N * K``)."""
    return math.ceil(capacity_factor * copies / num_experts)


def capacity_slots(experts: jax.Array, num_experts: int, slots: int) -> jax.Array:
    """Each routed copy's row in its expert's buffer of ``slots`` rows, or -1 when the buffer is full.

    Args:
      experts: ``[N, K]`` int32 chosen experts of the group's tokens.
      num_experts: E.
      slots: C, rows per expert.

    Returns:
      ``[N, K]`` int32 in ``[-1, C)``: copies fill their expert's rows in order (earlier tokens first,
      a token's higher-scored choice first); a copy past ``C`` gets -1 (dropped).
    """
    flat = experts.reshape(-1)
    order = stable_argsort(flat)
    sizes = jnp.bincount(flat, length=num_experts)
    starts = jnp.cumsum(sizes) - sizes
    position_sorted = jnp.arange(flat.size) - starts[flat[order]]
    position = jnp.zeros_like(position_sorted).at[order].set(position_sorted)
    return jnp.where(position < slots, position, -1).astype(jnp.int32).reshape(experts.shape)


def stable_argsort(key: jax.Array) -> jax.Array:
    """The permutation that sorts a 1-D ``key`` (equal keys in their order), typed to vary over the same
    manual mesh axes as ``key``.

    Inside `jax.shard_map`, `jnp.argsort` sorts ``(key, iota)`` and each output of XLA's sort keeps its
    own operand's type (``sort``'s abstract evaluation in JAX 0.10.2 and 0.12.0): the permutation of a
    device-varying key comes out typed device-invariant. Its values are right, but `jax.grad` trusts the
    type: a gather ``x[order]`` of an invariant ``x`` then transposes to a ``psum`` of the per-device
    cotangents scattered with each device's own permutation, which mixes rows of different devices (the
    expert layer's input gradient, whenever the tokens are whole over an ``expert`` axis). Sorting against
    an iota cast to the key's varying axes types the permutation correctly; outside a map nothing changes.

    Args:
      key: ``[R]`` integer keys.

    Returns:
      ``[R]`` int32 indices, ``key[order]`` non-decreasing.
    """
    iota = to_varying(jnp.arange(key.shape[0], dtype=jnp.int32), varying_axes(key))
    return jax.lax.sort((key, iota), num_keys=1, is_stable=True)[1]


def expert_outputs(
    x: jax.Array, experts: jax.Array, weights: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array, first=0
) -> jax.Array:
    """The routed experts' weighted output for each token: dropless grouped matrix products.

    The ``N*K`` copies routed to the experts held here (``first .. first+E_local-1``) are sorted by expert
    and multiplied by `jax.lax.ragged_dot`, one group of rows per expert. A token's ``K`` choices are
    distinct experts, so at most ``M = N * min(K, E_local)`` of the copies are held here: only the first
    ``M`` sorted copies are computed, which drops none (with the experts split over ``E_p`` devices and
    ``E_local < K``, the ring's gathered rows shrink from ``N K`` to ``N E_local``). The combine weight
    scales the hidden ``[M, F]`` before the down product (the output is linear in it), so no ``[M, D]``
    output is kept for its gradient, and the rows go back to their tokens by a scatter-add that drops the
    copies of other devices' experts, whatever their rows hold.

    Args:
      x: ``[N, D]`` tokens, compute dtype.
      experts: ``[N, K]`` int32 global expert indices.
      weights: ``[N, K]`` float32 combine weights (0 for a dropped copy).
      gate, up: ``[E_local, D, F]``; down: ``[E_local, F, D]`` (cast to ``x.dtype``).
      first: the global index of the first expert held here (int or int32 scalar).

    Returns:
      ``[N, D]`` in ``x.dtype``: ``sum_j weights[:, j] * expert_{experts[:, j]}(x)`` over the local experts.
    """
    n, k = experts.shape
    local_experts = gate.shape[0]
    local = experts.reshape(-1) - first
    held = (local >= 0) & (local < local_experts)
    key = jnp.where(held, local, local_experts)  # other devices' experts sort last
    order = stable_argsort(key)[: held_copies(n, k, local_experts)]
    sizes = jnp.bincount(key, length=local_experts + 1)[:local_experts].astype(jnp.int32)
    token = order // k
    rows = x[token]  # [M, D]
    dtype = x.dtype
    h_gate = jax.lax.ragged_dot(rows, gate.astype(dtype), sizes)
    h_up = jax.lax.ragged_dot(rows, up.astype(dtype), sizes)
    combine = jnp.where(held, weights.reshape(-1), 0.0)[order].astype(dtype)
    hidden = jax.nn.silu(h_gate) * h_up * combine[:, None]  # [M, F]
    out = jax.lax.ragged_dot(hidden, down.astype(dtype), sizes)  # [M, D]
    target = jnp.where(held[order], token, n)  # another device's copy: out of range, dropped
    return jnp.zeros((n, x.shape[-1]), dtype).at[target].add(out, mode="drop")


class MoE(nnx.Module):
    """Mixture-of-experts SwiGLU feed-forward (module docstring).

    Parameters (`models.spec.moe_params`): ``router [embed, expert]``, ``gate, up [expert, embed, mlp]``,
    ``down [expert, mlp, embed]`` and, with shared experts, ``shared`` (a `models.layers.MLP`).
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
        self.config = config
        make_params(self, rngs, tuple(p for p in moe_params(config) if "/" not in p.path))
        if config.lora_rank:
            self.lora_scale = lora.scale(config)
        if config.shared_experts:
            self.shared = MLP(config.embed_dim, config.shared_experts * config.expert_dim, rngs=rngs, config=config)

    def __call__(
        self, x: jax.Array, par: Parallelism, stats_axes: tuple[str, ...] = ()
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``[batch, length, embed]`` -> ``([batch, length, embed]`` in x's dtype, stats).

        ``stats_axes``: manual mesh axes the tokens of one group are split over (`router_losses`), so that
        the router losses are those of the whole group; the pipeline's stages pass the axes that split a
        microbatch.

        Returns:
          The output and ``{"aux", "z", "dropped", "load"}``, float32: the balancing loss and the z-loss
          over the tokens of ``x``, the routed copies dropped for capacity (0 when dropless), and the copies
          routed to each expert ``[E]`` (`router_losses`).
        """
        config = self.config
        logits = jnp.einsum("BTD,DE->BTE", x.astype(jnp.float32), self.router[...])
        weights, experts, probs = route(logits, config)
        stats = router_losses(
            logits.reshape(-1, config.num_experts),
            probs.reshape(-1, config.num_experts),
            experts.reshape(-1, config.experts_per_token),
            config.num_experts,
            stats_axes,
        )
        gate, up, down = (lora.weight(self, n) for n in ("gate", "up", "down"))
        routed, keep = _routed(x, experts, weights, gate, up, down, config, par)
        stats["dropped"] = jnp.sum(1.0 - keep.astype(jnp.float32))
        out = routed
        if config.shared_experts:
            out = out + self.shared(x, par)
        return par.constrain(out, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)), stats


def _group(x, experts, weights, gate, up, down, config: ModelConfig, first=0, gather_axes=(), sum_axes=()):
    """One group of tokens ``x [B, T, D]`` (one device's, or all) through the experts held here.

    With ``gather_axes`` the tokens and their routing are all-gathered over those mesh axes first and the
    outputs reduce-scattered back; ``sum_axes``: mesh axes the partial outputs are summed over (experts or
    ``mlp`` split there). Returns ``(out [B, T, D], keep [B, T, K] bool)``.
    """
    b, t, d = x.shape
    k = config.experts_per_token
    flat_x, flat_e, flat_w = x.reshape(-1, d), experts.reshape(-1, k), weights.reshape(-1, k)
    if config.capacity_factor:
        keep = capacity_keep(flat_e, config.num_experts, config.capacity_factor)
        flat_w = jnp.where(keep, flat_w, 0.0)
    else:
        keep = jnp.ones(flat_e.shape, bool)
    if gather_axes:
        flat_x, flat_e, flat_w = (
            jax.lax.all_gather(a, gather_axes, axis=0, tiled=True) for a in (flat_x, flat_e, flat_w)
        )
    out = expert_outputs(flat_x, flat_e, flat_w, gate, up, down, first)
    if gather_axes:
        out = jax.lax.psum_scatter(out, gather_axes, scatter_dimension=0, tiled=True)
    if sum_axes:
        out = jax.lax.psum(out, sum_axes)
    return out.reshape(b, t, d), keep.reshape(b, t, k)


def _all_to_all_group(x, experts, weights, gate, up, down, config: ModelConfig, axes, sum_axes=()):
    """One device's tokens ``x [B, T, D]`` through the experts of every device of ``axes``, dispatched by
    all-to-all into fixed buffers (GShard, Lepikhin et al., 2020, section 3.2), with a capacity.

    Each copy takes its row in its expert's buffer (`capacity_slots`; ``C`` rows per expert, the copies past
    it dropped); the ``[E * C, D]`` buffer goes to the devices holding the experts (``E / E_p`` experts'
    rows to each), which run their experts on ``E_p * C`` rows each, and a second all-to-all brings the rows
    back to be combined. The same copies are dropped as by `_group` (one device's tokens are the group).
    ``sum_axes``: mesh axes the partial outputs are summed over (``mlp`` split there).
    Returns ``(out [B, T, D], keep [B, T, K] bool)``.
    """
    b, t, d = x.shape
    k, e = config.experts_per_token, config.num_experts
    n, local_experts, dtype = b * t, gate.shape[0], x.dtype
    slots = capacity(n * k, e, config.capacity_factor)
    flat_x, flat_e, flat_w = x.reshape(n, d), experts.reshape(n, k), weights.reshape(n, k)
    position = capacity_slots(flat_e, e, slots)
    keep = position >= 0
    slot = jnp.where(keep, flat_e * slots + position, e * slots).reshape(-1)  # dropped: one spare row
    copy = jnp.full((e * slots + 1,), n * k, jnp.int32).at[slot].set(jnp.arange(n * k, dtype=jnp.int32))[:-1]
    rows = jnp.concatenate([flat_x, jnp.zeros((1, d), dtype)])[copy // k]  # [E*C, D]; empty rows are zero
    rows = jax.lax.all_to_all(rows, axes, 0, 0, tiled=True)  # [E_p * E_local * C, D], by source device
    rows = rows.reshape(-1, local_experts, slots, d).transpose(1, 0, 2, 3).reshape(local_experts, -1, d)
    h = jax.nn.silu(jnp.einsum("ERD,EDF->ERF", rows, gate.astype(dtype)))
    h = h * jnp.einsum("ERD,EDF->ERF", rows, up.astype(dtype))
    out = jnp.einsum("ERF,EFD->ERD", h, down.astype(dtype))
    out = out.reshape(local_experts, -1, slots, d).transpose(1, 0, 2, 3).reshape(-1, d)
    out = jax.lax.all_to_all(out, axes, 0, 0, tiled=True)  # [E*C, D], by expert
    picked = jnp.concatenate([out, jnp.zeros((1, d), dtype)])[slot].reshape(n, k, d)
    combine = jnp.where(keep, flat_w, 0.0).astype(dtype)
    y = jnp.sum(picked * combine[..., None], axis=1)
    if sum_axes:
        y = jax.lax.psum(y, sum_axes)
    return y.reshape(b, t, d), keep.reshape(b, t, k)


def _dispatches(*records: dispatch.ExpertDispatch) -> Callable[[Callable], Callable]:
    """Binds the decorated function to ``records`` (`sharding.dispatch`) as what performs them on one device,
    ``(x [B, T, D], experts [B, T, K], weights [B, T, K], gate, up, down, config, place) ->
    (out [B, T, D], keep [B, T, K] bool)``; each record then holds it (``record.run``).

    Raises:
      ValueError: When a record already has one (`sharding.bound.BindsRun.bind`).
    """

    def bind(run: Callable) -> Callable:
        for record in records:
            record.bind(run)
        return run

    return bind


@_dispatches(dispatch.LOCAL, dispatch.RING)
def _gathered(x, experts, weights, gate, up, down, config: ModelConfig, place: ExpertPlacement):
    """`_group` over ``place``: the tokens gathered over ``place.gather_axes`` (none without expert parallelism),
    this device's experts numbered from its index along ``place.expert_axes``."""
    index = jnp.zeros((), jnp.int32)
    for a in place.expert_axes:
        index = index * place.sizes[a] + jax.lax.axis_index(a)
    first = index * place.local_experts
    return _group(x, experts, weights, gate, up, down, config, first, place.gather_axes, place.sum_axes)


@_dispatches(dispatch.ALL_TO_ALL)
def _exchanged(x, experts, weights, gate, up, down, config: ModelConfig, place: ExpertPlacement):
    """`_all_to_all_group` over ``place.expert_axes``, the partial outputs summed over ``place.mlp_axes``."""
    return _all_to_all_group(x, experts, weights, gate, up, down, config, place.expert_axes, place.mlp_axes)


require_bound(dispatch.DISPATCHES)


def _layout(config: ModelConfig, par: Parallelism, x_shape) -> tuple[PartitionSpec, PartitionSpec, ExpertPlacement]:
    """The specs of the activations ``[B, T, D]`` (of ``x_shape``) and of the experts' ``gate, up [E, D, F]``
    under ``par`` (a mesh bound, no axis manual), and where a device's share sits
    (`sharding.expert_placement.expert_placement`, the decision the cost model reads too).

    Raises:
      ValueError: When the rules split the activations' embed over an axis that splits the experts or their
        ``mlp``.
    """
    x_spec = par.spec((ax.BATCH, ax.LENGTH, ax.ACT_EMBED), x_shape)
    in_spec = par.spec((ax.EXPERT, ax.EXPERT_EMBED, ax.MLP), (config.num_experts, config.embed_dim, config.expert_dim))
    return x_spec, in_spec, expert_placement(expert_geometry(config), par.rules, par.auto_shape, tuple(x_shape[:2]))


def layer_dispatch(config: ModelConfig, par: Parallelism, tokens_shape: tuple[int, int]) -> dispatch.ExpertDispatch:
    """The dispatch (`sharding.dispatch`) that the layer runs under ``par`` on activations of ``tokens_shape``
    ``[batch, length]`` (sequences and positions one call of the layer sees): `sharding.dispatch.LOCAL` on one
    device or inside another `jax.shard_map`; else the record `_routed` chooses for that shape, the ring
    where an axis that splits the experts does not split those tokens (a batch it does not divide, or rules
    that keep the batch whole over it): `sharding.expert_placement.expert_placement`'s, which the cost model
    reads too. The run report reads it.

    Raises:
      ValueError: As `_layout`.
    """
    placement = layer_placement(config, par, tokens_shape)
    return dispatch.LOCAL if placement is None else placement.dispatch


def layer_placement(config: ModelConfig, par: Parallelism, tokens_shape: tuple[int, int]) -> ExpertPlacement | None:
    """Where the layer's share sits under ``par`` on activations of ``tokens_shape`` ``[batch, length]``
    (`sharding.expert_placement.expert_placement`); None on one device or inside another `jax.shard_map` (the
    layer runs locally, `layer_dispatch`).

    Raises:
      ValueError: As `_layout`.
    """
    if not par.is_sharded or par.manual:
        return None
    return expert_placement(expert_geometry(config), par.rules, par.auto_shape, tuple(tokens_shape))


def _routed(x, experts, weights, gate, up, down, config: ModelConfig, par: Parallelism):
    """The routed experts' output ``[B, T, D]`` and the capacity mask ``[B, T, K]``, laid out by ``par``.

    On one device (or inside another `jax.shard_map`, where the enclosing strategy's checks keep the
    experts whole) the group is the whole input. On a mesh the layer runs per device under
    `jax.shard_map` with specs from the rules (module docstring). The experts' weights enter it split over
    their experts and ``mlp`` only: the partitioner gathers their ``expert_embed`` (split over ``fsdp``)
    before the map, so a device's output depends only on the axes that split its tokens, the experts and
    their ``mlp`` (a batch that ``fsdp`` does not divide stays whole over ``fsdp``).
    """
    if not par.is_sharded or par.manual:
        return _group(x, experts, weights, gate, up, down, config)
    x_spec, in_spec, place = _layout(config, par, x.shape)
    route_spec = par.spec((ax.BATCH, ax.LENGTH, None), experts.shape)
    weights_in = PartitionSpec(spec_entry(in_spec, 0), None, spec_entry(in_spec, 2))
    weights_out = PartitionSpec(spec_entry(in_spec, 0), spec_entry(in_spec, 2), None)
    run_dispatch = place.dispatch.run

    def local(x, experts, weights, gate, up, down):
        return run_dispatch(x, experts, weights, gate, up, down, config, place)

    run = jax.shard_map(
        local,
        mesh=par.mesh,
        in_specs=(x_spec, route_spec, route_spec, weights_in, weights_in, weights_out),
        out_specs=(x_spec, route_spec),
    )
    return run(x, experts, weights, gate, up, down)
