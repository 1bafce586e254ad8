"""Decoder-only language model with its layers stacked and scanned.

Einsum letters: B batch, T length, D embed, V vocab.

The ``num_layers`` blocks are created with `nnx.vmap`, so each block
parameter carries a leading ``layers`` dimension (its logical names gain
``layers`` in front), and run with `jax.lax.scan`, so compile time does not
grow with depth. Rematerialisation wraps the scanned block.

Every call takes the run's `sharding.parallel.Parallelism` (``par``; default
one device) and hands it to each layer. When it runs the model as a pipeline (a
``stage`` mesh axis larger than one), the stacked parameters are in the
pipeline layout ``[stage, slot, ...]`` instead (`init_params` with
``layer_table``) and `Transformer.run_layers` hands the per-layer function and
the stack to `sharding.pipeline.schedule.run_pipeline`, and `Transformer.loss_sums` hands it with the final norm,
output projection and loss as the head to `sharding.pipeline.onef1b.run_pipeline_loss` (which the 1F1B
schedule runs inside the pipeline; after a gpipe or circular pipeline the head runs on 1/S of the rows
per stage, `sharding.pipeline.head_parallelism`); the model itself never names a mesh axis.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from models import lora
from models.attention import Attention
from models.config import ModelConfig
from models.layers import MLP, Embed, RMSNorm, make_params
from models.moe import MoE, router_objective
from models.output import output_loss_sums, project_logits
from models.spec import output_params
from sharding import axes as ax
from sharding.errors import ConfigError, Field
from sharding.parallel import Parallelism
from sharding.pipeline import head_parallelism
from sharding.pipeline.onef1b import run_pipeline_loss
from sharding.pipeline.schedule import run_pipeline

_REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _dtype(name: str):
    return {"float32": jnp.float32, "bfloat16": jnp.bfloat16}[name]


class Block(nnx.Module):
    """Pre-norm transformer block: ``x + attn(norm(x))``, then ``+ mlp(norm(x))``; with ``moe`` the
    feed-forward is a mixture of experts (`models.moe.MoE`, attribute ``moe``) instead of ``mlp``."""

    def __init__(self, config: ModelConfig, moe: bool = False, *, rngs: nnx.Rngs):
        self.attention_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs=rngs)
        self.attention = Attention(config, rngs=rngs)
        self.mlp_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs=rngs)
        if moe:
            self.moe = MoE(config, rngs=rngs)
        else:
            self.mlp = MLP(config.embed_dim, config.mlp_dim, rngs=rngs, config=config)

    def __call__(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, par: Parallelism
    ) -> jax.Array:
        """``[batch, length, embed]`` -> same shape and dtype (a mixture of experts' losses dropped:
        `forward` returns them)."""
        return self.forward(x, positions, segment_ids, par)[0]

    def forward(
        self,
        x: jax.Array,
        positions: jax.Array,
        segment_ids: jax.Array | None,
        par: Parallelism,
        stats_axes: tuple[str, ...] = (),
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """``[batch, length, embed]`` -> (same shape and dtype, the mixture of experts' float32 scalars
        ``aux``, ``z``, ``dropped`` (`models.moe.MoE`), empty for a dense block). ``stats_axes``: as
        `models.moe.MoE`."""
        x = x + self.attention(_block_input(self.attention_norm(x), par), positions, segment_ids, par)
        stats = {}
        if hasattr(self, "moe"):
            y, stats = self.moe(_block_input(self.mlp_norm(x), par), par, stats_axes)
        else:
            y = self.mlp(_block_input(self.mlp_norm(x), par), par)
        return par.constrain(x + y, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)), stats

    def extend(self, x: jax.Array, positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array, par: Parallelism):
        """`__call__` for new tokens over a key/value cache (`models.attention.Attention.extend`).

        Returns ``(x, k_cache, v_cache)``.
        """
        y, k_cache, v_cache = self.attention.extend(self.attention_norm(x), positions, k_cache, v_cache, par)
        x = x + y
        x = x + (self.moe(self.mlp_norm(x), par)[0] if hasattr(self, "moe") else self.mlp(self.mlp_norm(x), par))
        return par.constrain(x, (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)), k_cache, v_cache


def _block_input(h: jax.Array, par: Parallelism) -> jax.Array:
    """A normalised residual ``[batch, length, embed]`` laid out as the attention or MLP block reads it: its
    length split as the block's (``length``), not as the residual stream's (``act_length``). Under sequence
    parallelism this is where the partitioner all-gathers the length over ``tensor`` (Korthikanti et al.,
    2022, section 4.2.2); elsewhere the two names split alike and this changes nothing."""
    return par.constrain(h, (ax.BATCH, ax.LENGTH, ax.ACT_EMBED))


def _make_stack(config: ModelConfig, moe: bool, keys: jax.Array) -> Block:
    """Blocks stacked on a leading dimension, one per key of ``keys [n]`` (`nnx.vmap`)."""

    @nnx.vmap(in_axes=0, out_axes=0)
    def make_block(key):
        return Block(config, moe, rngs=nnx.Rngs(params=key))

    return make_block(keys)


def _add_layers_axis(module: nnx.Module) -> None:
    """Prepends ``layers`` to the logical names of every parameter of a stacked module."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable):
            names = node.get_metadata().get("logical_axes")
            if names is not None:
                node.set_metadata("logical_axes", (ax.LAYERS,) + tuple(names))


def _extend_scan(stack: nnx.Module, x, positions, k_cache, v_cache, par: Parallelism, *, rows=None, stacked=None):
    """Scans `Block.extend` over a stack of blocks and their cache rows ``[n, batch, max_length, kv_heads,
    head_dim]``: ``stacked`` (that stack's parameters, default all of it) or its ``rows``.
    Returns ``(x, (k_cache, v_cache))``."""
    graphdef, state = nnx.split(stack)
    if stacked is None:
        stacked = state if rows is None else jax.tree.map(lambda w: w[rows], state)

    def body(h, layer):
        layer_state, k, v = layer
        h, k, v = nnx.merge(graphdef, layer_state).extend(h, positions, k, v, par)
        return h, (k, v)

    return jax.lax.scan(body, x, (stacked, k_cache, v_cache))


class Transformer(nnx.Module):
    """The LM: embed, ``num_layers`` blocks, final RMSNorm, output projection.

    Parameters: ``embed/embedding [vocab, embed]``, ``layers/...`` with a
    leading ``[layers]`` dimension, ``final_norm/scale [embed]`` and, unless
    embeddings are tied, ``unembed [embed, vocab]``.
    """

    def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs, layer_order=None):
        """Builds the parameters.

        Args:
          config: the model.
          rngs: random streams (``params``).
          layer_order: optional int array ``[n]`` of layer indices (-1: an
            empty slot, built from layer 0's key): the stacked blocks are
            layers ``layer_order`` in that order, with exactly the values
            those layers have in the canonical ``0..num_layers-1`` stack
            (a model of one stack: dense, or a mixture of experts in every layer).

        Raises:
          ValueError: ``layer_order`` for a mixture of experts with dense layers.
        """
        self.config = config
        self.embed = Embed(config.vocab_size, config.embed_dim, rngs=rngs)
        keys = jax.random.split(rngs.params(), config.num_layers)
        if layer_order is not None:
            keys = keys[jnp.maximum(jnp.asarray(layer_order), 0)]
        kinds = np.asarray(config.layer_kinds())
        stacks = config.layer_stacks()
        if layer_order is not None and len(stacks) > 1:
            raise ValueError("layer_order needs a model whose layers are alike (one stack)")
        for name, moe, _ in stacks:
            # Layer i keeps the key of its place in the model, whichever stack holds it; with layer_order the one
            # stack's rows are the keys as ordered.
            one = layer_order is not None or len(stacks) == 1
            stack = _make_stack(config, moe, keys if one else keys[np.flatnonzero(kinds == moe)])
            _add_layers_axis(stack)
            setattr(self, name, stack)
        self.final_norm = RMSNorm(config.embed_dim, config.norm_eps, rngs=rngs)
        make_params(self, rngs, output_params(config))  # unembed, unless tied

    def run_layers(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, par: Parallelism
    ) -> jax.Array:
        """Runs the stacked blocks over ``x [batch, length, embed]``.

        Scanned in order; when ``par`` has a pipeline (``par.pipeline``), run as a
        pipeline over the stages instead (parameters in the plan's layout).
        """
        return self.run_layers_with_stats(x, positions, segment_ids, par)[0]

    def run_layers_with_stats(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array | None, par: Parallelism
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """`run_layers`, also returning the mixture-of-experts layers' statistics: ``aux`` and ``z`` (means
        over those layers) and ``dropped`` (summed), float32 scalars, and ``load [moe_layers, experts]``
        (float32 counts of the copies routed to each expert of each MoE layer); empty for a dense model.

        A mixture of experts scans its first dense layers, then ``num_moe_layers`` periods, each
        ``moe_every - 1`` dense layers and one mixture-of-experts layer (`ModelConfig.layer_kinds`).
        """
        if not self.config.is_moe:
            graphdef, stacked = nnx.split(self.layers)
            if par.pipeline is not None:
                return self._run_pipelined(graphdef, stacked, x, positions, segment_ids, par), {}
            return self._scan(graphdef, stacked, x, positions, segment_ids, par)[0], {}
        if par.pipeline is not None:
            # A pipeline runs one stack of like blocks: a mixture of experts whose every layer is one
            # (`train.setup.checks.check_experts` refuses the others). Its router statistics stay inside the stages.
            if hasattr(self, "dense_layers"):
                raise ValueError(
                    "pipeline stages run a mixture of experts whose every layer is one: first_dense_layers=0, "
                    "moe_every=1"
                )
            moe_def, moe_stacked = nnx.split(self.layers)
            return self._run_pipelined(moe_def, moe_stacked, x, positions, segment_ids, par), {}
        first, period = self.config.first_dense_layers, self.config.moe_every
        moe_def, moe_stacked = nnx.split(self.layers)
        if first:
            dense_def, dense_stacked = nnx.split(self.dense_layers)
            head = jax.tree.map(lambda w: w[:first], dense_stacked)
            x, _ = self._scan(dense_def, head, x, positions, segment_ids, par)
        if period == 1:
            x, stats = self._scan(moe_def, moe_stacked, x, positions, segment_ids, par)
        else:
            dense_def, dense_stacked = nnx.split(self.dense_layers)
            rest = jax.tree.map(lambda w: w[first:].reshape(-1, period - 1, *w.shape[1:]), dense_stacked)

            def one_period(h, layers):  # moe_every - 1 dense layers, then one mixture of experts
                dense, moe = layers
                h, _ = self._scan(dense_def, dense, h, positions, segment_ids, par)
                return self._body(moe_def, positions, segment_ids, par)(h, moe)

            x, stats = jax.lax.scan(one_period, x, (rest, moe_stacked))
        totals = {
            "aux": jnp.mean(stats["aux"]),
            "z": jnp.mean(stats["z"]),
            "dropped": jnp.sum(stats["dropped"]),
            "load": stats["load"],
        }
        return x, totals

    def _scan(self, graphdef, stacked, x, positions, segment_ids, par: Parallelism):
        """Scans the blocks of one stack over ``x``, remat per block; ``(x, per-block stats stacked)``."""
        return jax.lax.scan(self._body(graphdef, positions, segment_ids, par), x, stacked)

    def _body(self, graphdef, positions, segment_ids, par: Parallelism):
        """One block ``(h, layer_state) -> (h, stats)`` under the remat policy."""

        def body(h, layer_state):
            return nnx.merge(graphdef, layer_state).forward(h, positions, segment_ids, par)

        if self.config.remat != "none":
            body = jax.checkpoint(body, policy=_REMAT_POLICIES[self.config.remat], prevent_cse=False)
        return body

    def _run_pipelined(self, graphdef, stacked, x, positions, segment_ids, par: Parallelism) -> jax.Array:
        """`run_pipeline` with one block as the layer function (it applies the remat policy per block); the
        parameters' logical names tell it how each is split over ``data``/``fsdp``."""
        policy = _REMAT_POLICIES.get(self.config.remat)
        x, _ = run_pipeline(
            _pipeline_layer(graphdef),
            stacked,
            x,
            (positions, segment_ids),
            par,
            names=_logical_names(stacked),
            remat_policy=policy,
            recompute=self.config.remat == "full",
        )
        return x

    def _pipelined_loss_sums(
        self, tokens, targets, weights, positions, segment_ids, par: Parallelism, with_stats: bool = False
    ):
        """`loss_sums` through `sharding.pipeline.onef1b.run_pipeline_loss`: the final norm, output projection and
        loss are its head, which the 1F1B schedule runs on the last stage inside the pipeline. With
        ``with_stats`` (a mixture of experts), ``(loss_sum, weight_sum, stats)`` as `pipelined_loss_stats`. The
        token embedding is its entry: run on the whole batch first, or per microbatch on the first stage where
        the 1F1B loop streams its edges (`sharding.pipeline.edges.Entry`)."""
        if hasattr(self, "dense_layers"):
            raise ValueError(
                "pipeline stages run a mixture of experts whose every layer is one: first_dense_layers=0, moe_every=1"
            )
        graphdef, stacked = nnx.split(self.layers)
        norm_def, norm_state = nnx.split(self.final_norm)
        embed_def, embed_state = nnx.split(self.embed)
        dtype = _dtype(self.config.dtype)

        def entry(entry_par, embed_params, tokens):
            return nnx.merge(embed_def, embed_params)(tokens, dtype, entry_par)

        weight, vocab_last = self.output_weight()
        weight_var = self.embed.embedding if self.config.tie_embeddings else self.unembed
        impl = self.config.logits

        def head(head_par, head_params, h, targets, weights):
            names = (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)
            x = head_par.constrain(nnx.merge(norm_def, head_params["norm"])(head_par.constrain(h, names)), names)
            return output_loss_sums(
                x, head_params["weight"], targets, weights, impl=impl, vocab_last=vocab_last, par=head_par
            )

        head_names = {"norm": _logical_names(norm_state), "weight": tuple(weight_var.get_metadata()["logical_axes"])}
        moe = self.config.is_moe
        out = run_pipeline_loss(
            _pipeline_moe_layer(graphdef, self.config) if moe else _pipeline_layer(graphdef),
            head,
            stacked,
            {"norm": norm_state, "weight": weight},
            tokens,
            (positions, segment_ids, weights) if moe else (positions, segment_ids),
            (targets, weights),
            par,
            names=_logical_names(stacked),
            head_names=head_names,
            remat_policy=_REMAT_POLICIES.get(self.config.remat),
            recompute=self.config.remat == "full",
            objective=_pipeline_objective_size(self.config) if moe else 0,
            entry_fn=entry,
            entry_params=embed_state,
            entry_names=_logical_names(embed_state),
        )
        if not with_stats:
            return out[0], out[1]
        summed = out[3]
        stats = {"aux_sum": summed[0], "z_sum": summed[1], "dropped": summed[2], "load": summed[3:]}
        return out[0], out[1], stats

    def pipelined_loss_stats(
        self, tokens, targets, weights, positions=None, segment_ids=None, *, par: Parallelism
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """`loss_sums` of a mixture of experts run as a pipeline, and its router statistics summed over the
        pipeline's microbatches, as gradient accumulation over the same microbatches sums them.

        Args:
          tokens, targets, weights, positions, segment_ids: as `loss_sums`.
          par: the run's layout, whose ``pipeline`` is set.

        Returns:
          ``(loss_sum, weight_sum, stats)``: the summed objective (router losses included) and tokens,
          float32 scalars, and ``stats``: ``aux_sum`` and ``z_sum`` (each microbatch's balancing and z-loss,
          means over the MoE layers, times its tokens), ``dropped`` (routed copies dropped for capacity) and
          ``load [experts]`` (the routed copies each expert received, summed over the MoE layers), float32.
        """
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        return self._pipelined_loss_sums(tokens, targets, weights, positions, segment_ids, par, with_stats=True)

    def __call__(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        par: Parallelism,
    ) -> jax.Array:
        """Next-token logits.

        Args:
          tokens: ``[batch, length]`` int32 token ids.
          positions: ``[batch, length]`` int32 rotary positions; default
            ``0..length-1`` in every row.
          segment_ids: ``[batch, length]`` int32 document ids of packed
            sequences (tokens attend only within their document), or None.
          par: the run's layout (`sharding.parallel.Parallelism`); default one device.

        Returns:
          ``[batch, length, vocab]`` float32 logits.
        """
        x = self.features(tokens, positions, segment_ids, par=par)
        weight, vocab_last = self.output_weight()
        logits = head_parallelism(par).constrain(project_logits(x, weight, vocab_last), (ax.BATCH, ax.LENGTH, ax.VOCAB))
        return par.constrain(logits, (ax.BATCH, ax.LENGTH, ax.VOCAB))

    def features(
        self,
        tokens: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        par: Parallelism,
    ) -> jax.Array:
        """The final activations ``[batch, length, embed]`` (after the last norm), compute dtype.

        With a pipeline the rows leave the layer stack split over ``stage`` too
        (`sharding.pipeline.head_parallelism`): each stage normalises, projects and scores 1/S of them.

        Arguments as `__call__`.
        """
        return self._features(tokens, positions, segment_ids, par)[0]

    def _features(self, tokens, positions, segment_ids, par: Parallelism):
        """`features` and the mixture-of-experts statistics (`run_layers_with_stats`)."""
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
        x = self.embed(tokens, _dtype(self.config.dtype), par)
        x, stats = self.run_layers_with_stats(x, positions, segment_ids, par)
        head = head_parallelism(par)
        names = (ax.BATCH, ax.ACT_LENGTH, ax.ACT_EMBED)
        return head.constrain(self.final_norm(head.constrain(x, names)), names), stats

    def extend(
        self, tokens: jax.Array, starts: jax.Array, cache: dict[str, jax.Array], par: Parallelism
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Runs new tokens against a key/value cache: prefill (``starts`` 0) or one decoding step.

        Args:
          tokens: ``[batch, new]`` int32; row b's sit at positions ``starts[b] + arange(new)``.
          starts: ``[batch]`` int32 cache position of each row's first new token.
          cache: ``{"k", "v"}``, each ``[layers, batch, max_length, kv_heads, head_dim]``
            (`models.generation.init_cache`).
          par: the run's layout (no pipeline).

        Returns:
          ``(logits [batch, new, vocab] float32, cache)`` with the new keys and values written.

        Raises:
          ValueError: ``par`` is a pipeline (decoding runs the layer stack as a scan).
        """
        if par.pipeline is not None:
            raise ConfigError("decoding runs without pipeline stages; use a ", Field("mesh"), " without stage")
        positions = starts[:, None].astype(jnp.int32) + jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
        x = self.embed(tokens, _dtype(self.config.dtype), par)
        if hasattr(self, "dense_layers"):
            x, k, v = self._extend_mixed(x, positions, cache["k"], cache["v"], par)
        else:
            x, (k, v) = _extend_scan(self.layers, x, positions, cache["k"], cache["v"], par)
        weight, vocab_last = self.output_weight()
        logits = par.constrain(project_logits(self.final_norm(x), weight, vocab_last), (ax.BATCH, ax.LENGTH, ax.VOCAB))
        return logits, {"k": k, "v": v}

    def _extend_mixed(self, x, positions, k_cache, v_cache, par: Parallelism):
        """`extend`'s layers for a mixture of experts with dense layers, in the order of `run_layers_with_stats`:
        the first dense layers, then periods of ``moe_every - 1`` dense layers and one mixture of experts; the
        caches ``[layers, ...]`` are in model order, so each period takes ``moe_every`` consecutive rows.
        Returns ``(x, k_cache, v_cache)``."""
        first, period = self.config.first_dense_layers, self.config.moe_every
        moe_def, moe_stacked = nnx.split(self.layers)
        heads_k, heads_v = [], []
        if first:
            x, (hk, hv) = _extend_scan(
                self.dense_layers, x, positions, k_cache[:first], v_cache[:first], par, rows=slice(0, first)
            )
            heads_k, heads_v = [hk], [hv]
        periods = self.config.num_moe_layers
        rest_k = k_cache[first:].reshape(periods, period, *k_cache.shape[1:])
        rest_v = v_cache[first:].reshape(periods, period, *v_cache.shape[1:])
        _, dense_stacked = nnx.split(self.dense_layers)
        dense_rest = jax.tree.map(lambda w: w[first:].reshape(periods, period - 1, *w.shape[1:]), dense_stacked)

        def one_period(h, layer):
            dense, moe, k, v = layer
            ks, vs = [], []
            if period > 1:
                h, (dk, dv) = _extend_scan(self.dense_layers, h, positions, k[:-1], v[:-1], par, stacked=dense)
                ks, vs = [dk], [dv]
            h, mk, mv = nnx.merge(moe_def, moe).extend(h, positions, k[-1], v[-1], par)
            return h, (jnp.concatenate([*ks, mk[None]]), jnp.concatenate([*vs, mv[None]]))

        x, (k, v) = jax.lax.scan(one_period, x, (dense_rest, moe_stacked, rest_k, rest_v))
        k = jnp.concatenate([*heads_k, k.reshape(-1, *k.shape[2:])])
        v = jnp.concatenate([*heads_v, v.reshape(-1, *v.shape[2:])])
        return x, k, v

    def output_weight(self) -> tuple[jax.Array, bool]:
        """``(weight, vocab_last)``: ``unembed [embed, vocab]``, or the embedding table ``[vocab, embed]`` when tied."""
        if self.config.tie_embeddings:
            return self.embed.embedding[...], False
        return self.unembed[...], True

    def loss_sums(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        weights: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        par: Parallelism,
    ) -> tuple[jax.Array, jax.Array]:
        """The summed training objective, ``(loss_sum, weight_sum)`` float32 scalars (nats).

        For a dense model ``loss_sum`` is the summed next-token cross-entropy. For a mixture of experts it
        adds ``weight_sum * (router_aux_coef * aux + router_z_coef * z)`` (`loss_terms`), so that the step's
        division by the tokens gives the mean cross-entropy plus the weighted router losses.

        The output projection and the loss are computed together as ``ModelConfig.logits``
        says (`models.output.output_loss_sums`), without materialising the whole logits when
        that layout is vocabulary-parallel.

        Args:
          tokens, positions, segment_ids, par: as `__call__`.
          targets: ``[batch, length]`` int32 next tokens.
          weights: ``[batch, length]`` float32 loss mask.
        """
        if par.pipeline is not None:
            if positions is None:
                positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
            return self._pipelined_loss_sums(tokens, targets, weights, positions, segment_ids, par)
        loss_sum, weight_sum, stats = self.loss_terms(tokens, targets, weights, positions, segment_ids, par=par)
        if stats:
            loss_sum = loss_sum + router_objective(self.config, stats, weight_sum)
        return loss_sum, weight_sum

    def loss_terms(
        self,
        tokens: jax.Array,
        targets: jax.Array,
        weights: jax.Array,
        positions: jax.Array | None = None,
        segment_ids: jax.Array | None = None,
        *,
        par: Parallelism,
    ) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
        """``(cross-entropy sum, weight_sum, stats)``: `loss_sums`' parts kept apart (no pipeline).

        ``stats`` are the mixture-of-experts float32 scalars ``aux`` (load-balancing loss, mean over the MoE
        layers), ``z`` (router z-loss, mean) and ``dropped`` (routed copies dropped for capacity, summed),
        and ``load [moe_layers, experts]`` (copies routed to each expert); empty for a dense model.
        """
        x, stats = self._features(tokens, positions, segment_ids, par)
        weight, vocab_last = self.output_weight()
        loss_sum, weight_sum = output_loss_sums(
            x, weight, targets, weights, impl=self.config.logits, vocab_last=vocab_last, par=head_parallelism(par)
        )
        return loss_sum, weight_sum, stats


def _pipeline_layer(graphdef):
    """One block as `sharding.pipeline.schedule.run_pipeline`'s layer function ``(par, layer_state, h, positions,
    segment_ids) -> h``."""

    def layer(stage_par, layer_state, h, positions, segment_ids):
        return nnx.merge(graphdef, layer_state)(h, positions, segment_ids, stage_par)

    return layer


def _pipeline_moe_layer(graphdef, config: ModelConfig):
    """One mixture-of-experts block as a pipeline layer with an objective (`sharding.pipeline.onef1b.run_pipeline_loss`
    with ``objective``): ``(par, layer_state, h, positions, segment_ids, loss_mask, batch_axes) -> (h,
    objective)``.

    The objective ``[4 + experts]`` float32 is this device's part of the sums the pipeline adds up over the
    devices, layers and microbatches (`_pipeline_objective_size`). Entry 0 is what the block adds to the
    summed loss: its router losses over the whole microbatch (statistics summed over ``batch_axes``, the
    manual axes that split the microbatch's rows) times this device's tokens of it (``loss_mask [rows,
    length]`` float32), over the MoE layers (`router_objective`). Summed, it is what the unpipelined model
    adds per microbatch of gradient accumulation: ``tokens * (router_aux_coef * aux + router_z_coef * z)``,
    ``aux`` and ``z`` the means over its MoE layers. The statistics follow, summed likewise: ``tokens * aux /
    moe_layers``, ``tokens * z / moe_layers``, the copies dropped on this device's rows, and the whole
    microbatch's per-expert load over the devices that split it (so that their sum is the load once).
    """

    def layer(stage_par, layer_state, h, positions, segment_ids, loss_mask, batch_axes=()):
        h, stats = nnx.merge(graphdef, layer_state).forward(h, positions, segment_ids, stage_par, batch_axes)
        tokens = jnp.sum(loss_mask)
        moe_layers = config.num_moe_layers
        objective = router_objective(config, stats, tokens) / moe_layers
        sharing = math.prod(stage_par.mesh_shape[a] for a in batch_axes)  # devices holding the same summed load
        parts = [objective, tokens * stats["aux"] / moe_layers, tokens * stats["z"] / moe_layers, stats["dropped"]]
        return h, jnp.concatenate([jnp.stack(parts).astype(jnp.float32), stats["load"] / sharing])

    return layer


def _pipeline_objective_size(config: ModelConfig) -> int:
    """Entries of a pipelined MoE layer's objective (`_pipeline_moe_layer`): the router objective, the
    balancing and z-loss sums, the dropped copies, and one load per expert."""
    return 4 + config.num_experts


def _logical_names(state):
    """The logical axis names of each parameter of an `nnx.State` (a tree of tuples shaped as it)."""
    return jax.tree.map(
        lambda v: tuple(v.get_metadata()["logical_axes"]), state, is_leaf=lambda v: isinstance(v, nnx.Variable)
    )


# Functional interface ------------------------------------------------------


def to_pure_dict(state) -> dict[str, Any]:
    """An `nnx.State` as a plain nested dict of arrays (across flax versions)."""
    if hasattr(nnx, "to_pure_dict"):
        return nnx.to_pure_dict(state)
    return state.to_pure_dict()


def abstract_model(config: ModelConfig):
    """``(graphdef, abstract_params, names)`` without allocating parameters.

    Returns:
      graphdef: the model's `nnx.GraphDef`, for `apply`.
      abstract_params: nested dict of `jax.ShapeDtypeStruct` (float32; with adapters and ``lora_base_dtype``
        bfloat16, the frozen base bfloat16: `models.lora.held_in_dtype`).
      names: the same nested dict with each parameter's logical axis names.
    """
    model = nnx.eval_shape(lambda: Transformer(config, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(model)
    names: dict[str, Any] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Param):
            target = names
            for key in path[:-1]:
                target = target.setdefault(str(key), {})
            target[str(path[-1])] = tuple(node.get_metadata()["logical_axes"])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), to_pure_dict(state))
    return graphdef, lora.held_in_dtype(config, abstract), names


def init_params(config: ModelConfig, key: jax.Array, layer_table=None) -> dict[str, Any]:
    """Fresh parameters as a nested dict (call under `jax.jit` with out_shardings).

    Args:
      config: the model.
      key: the parameter key.
      layer_table: optional int array of layer indices, -1 for an empty row
        (``[rows]``, `sharding.pipeline.storage.stack_table` of the unpadded
        storage, or ``[stages, slots]``, `sharding.pipeline.StageLayout.layer_table`):
        then every ``layers/...`` parameter has the table's shape in front,
        each row holding the values its layer has in the canonical stack and
        empty rows zero. Only those rows are built, never the canonical stack.

    Returns:
      Nested dict of float32 arrays (the frozen base in ``lora_base_dtype``: `models.lora.held_in_dtype`);
      ``layers/...`` stacked ``[num_layers, ...]``
      or, with ``layer_table``, ``[*layer_table.shape, ...]``.
    """
    if layer_table is None:
        model = Transformer(config, rngs=nnx.Rngs(params=key))
        return lora.held_in_dtype(config, to_pure_dict(nnx.state(model, nnx.Param)))
    table = np.asarray(layer_table)
    model = Transformer(config, rngs=nnx.Rngs(params=key), layer_order=table.reshape(-1))
    params = to_pure_dict(nnx.state(model, nnx.Param))
    filled = jnp.asarray(table >= 0)

    def lay_out(w):
        w = w.reshape(*table.shape, *w.shape[1:])
        return jnp.where(filled.reshape(*table.shape, *([1] * (w.ndim - table.ndim))), w, jnp.zeros((), w.dtype))

    params["layers"] = jax.tree.map(lay_out, params["layers"])
    return lora.held_in_dtype(config, params)


def apply(graphdef, params: dict[str, Any], tokens, positions=None, segment_ids=None, *, par: Parallelism) -> jax.Array:
    """Runs the model from a graphdef and a params dict; see `Transformer.__call__`."""
    return nnx.merge(graphdef, params)(tokens, positions, segment_ids, par=par)


def loss_sums(
    graphdef, params: dict[str, Any], tokens, targets, weights, positions=None, segment_ids=None, *, par: Parallelism
) -> tuple[jax.Array, jax.Array]:
    """Summed cross-entropy from a graphdef and a params dict; see `Transformer.loss_sums`."""
    return nnx.merge(graphdef, params).loss_sums(tokens, targets, weights, positions, segment_ids, par=par)


def loss_terms(
    graphdef, params: dict[str, Any], tokens, targets, weights, positions=None, segment_ids=None, *, par: Parallelism
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Cross-entropy sum, weight sum and MoE statistics from a graphdef and a params dict; see
    `Transformer.loss_terms`."""
    return nnx.merge(graphdef, params).loss_terms(tokens, targets, weights, positions, segment_ids, par=par)


def pipelined_loss_stats(
    graphdef, params: dict[str, Any], tokens, targets, weights, positions=None, segment_ids=None, *, par: Parallelism
) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """Summed objective, weight sum and router statistics of a pipelined mixture of experts from a graphdef and
    a params dict; see `Transformer.pipelined_loss_stats`."""
    model = nnx.merge(graphdef, params)
    return model.pipelined_loss_stats(tokens, targets, weights, positions, segment_ids, par=par)


def extend(
    graphdef, params: dict[str, Any], cache: dict[str, jax.Array], tokens, starts, par: Parallelism
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """New tokens against a key/value cache from a graphdef and a params dict; see `Transformer.extend`."""
    return nnx.merge(graphdef, params).extend(tokens, starts, cache, par)
