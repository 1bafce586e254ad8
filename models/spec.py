"""The model describes itself, from the same tables that build it.

Each module's parameters are listed once, here, as `sharding.modeldesc.Param` entries (shape,
logical axes, role, init); `models.layers`, `models.attention` and `models.transformer` create their
`nnx.Param`s from these tables (`models.layers.make_params`), so the description cannot drift from
the modules (``tests/test_model.py`` compares it with `models.transformer.abstract_model`).

`describe` adds what the cost model (`sharding.costmodel`) needs besides the parameters: the
matrix products, the attention geometry, the elementwise FLOPs per token of a layer and of the loss
(op counts of `models.layers` and `models.attention`), and the activations a layer saves per token
for the backward pass, each term with the logical axis that splits it.

Einsum letters as in the modules: D embed, F mlp, N heads, K kv heads, H head_dim, V vocab, E experts.
"""

from __future__ import annotations

import dataclasses
import functools

from models.attention_registry import KERNELS
from models.config import ModelConfig
from models.lora import adapter_params
from sharding import axes as ax
from sharding.modeldesc import AttentionGeometry, ExpertGeometry, ModelDescription, Param, Product, Term

__all__ = [
    "attention_params",
    "block_params",
    "describe",
    "embed_params",
    "mlp_params",
    "moe_params",
    "norm_params",
    "output_params",
]


# Parameter tables, one per module -------------------------------------------------------------


def embed_params(vocab_size: int, embed_dim: int) -> tuple[Param, ...]:
    """`models.layers.Embed`: the table ``embedding [vocab, embed]`` (standard deviation 1)."""
    return (Param("embedding", (vocab_size, embed_dim), (ax.VOCAB, ax.EMBED), role="embedding", fan_in=1),)


def norm_params(dim: int) -> tuple[Param, ...]:
    """`models.layers.RMSNorm`: ``scale [embed]``, ones."""
    return (Param("scale", (dim,), (ax.EMBED,), role="scale", init="ones"),)


def mlp_params(embed_dim: int, mlp_dim: int, config: ModelConfig | None = None) -> tuple[Param, ...]:
    """`models.layers.MLP` (SwiGLU): ``gate, up [embed, mlp]``, ``down [mlp, embed]``; with ``config``'s
    adapters, their factors after them (`models.lora.adapter_params`)."""
    d, f = embed_dim, mlp_dim
    weights = (
        Param("gate", (d, f), (ax.EMBED, ax.MLP)),
        Param("up", (d, f), (ax.EMBED, ax.MLP)),
        Param("down", (f, d), (ax.MLP, ax.EMBED)),
    )
    return weights + (adapter_params(weights, config) if config is not None else ())


def moe_params(config: ModelConfig) -> tuple[Param, ...]:
    """`models.moe.MoE`: the router ``router [embed, router_experts]``, the experts' SwiGLU weights stacked on
    the experts dimension, ``gate, up [expert, expert_embed, mlp]`` and ``down [expert, mlp, expert_embed]``
    (fan-in of one expert's product), and with ``shared_experts`` the shared SwiGLU ``shared/gate, shared/up
    [embed, mlp]``, ``shared/down [mlp, embed]`` of width ``shared_experts * moe_mlp_dim``.

    The router is a weight outside the experts: its ``embed`` is split like every other weight's (over
    ``fsdp`` and ``expert``) and its experts dimension stays whole (each token scores every expert). The
    experts' ``expert_embed`` is split over ``fsdp`` only, their experts dimension over ``expert``
    (`sharding.axes`)."""
    d, f, e = config.embed_dim, config.expert_dim, config.num_experts
    routed = (
        Param("router", (d, e), (ax.EMBED, ax.ROUTER_EXPERTS)),
        Param("gate", (e, d, f), (ax.EXPERT, ax.EXPERT_EMBED, ax.MLP), fan_in=d),
        Param("up", (e, d, f), (ax.EXPERT, ax.EXPERT_EMBED, ax.MLP), fan_in=d),
        Param("down", (e, f, d), (ax.EXPERT, ax.MLP, ax.EXPERT_EMBED), fan_in=f),
    )
    routed += adapter_params(routed, config)
    if not config.shared_experts:
        return routed
    return routed + tuple(p.under("shared") for p in mlp_params(d, config.shared_experts * f, config))


def attention_params(config: ModelConfig) -> tuple[Param, ...]:
    """`models.attention.Attention`: ``q [embed, heads, head_dim]``, ``k, v [embed, kv_heads, head_dim]``,
    ``o [heads, head_dim, embed]`` (fan-in ``heads * head_dim``); with ``qkv_bias`` (Qwen2), zero-initialised
    ``q_bias [heads, head_dim]``, ``k_bias, v_bias [kv_heads, head_dim]``; with ``qk_norm`` (Qwen3), the
    RMSNorm scales ``q_norm, k_norm [head_dim]`` (ones)."""
    d, n, k, h = config.embed_dim, config.num_heads, config.num_kv_heads, config.head_dim
    weights = (
        Param("q", (d, n, h), (ax.EMBED, ax.HEADS, ax.HEAD_DIM)),
        Param("k", (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM)),
        Param("v", (d, k, h), (ax.EMBED, ax.KV_HEADS, ax.HEAD_DIM)),
        Param("o", (n, h, d), (ax.HEADS, ax.HEAD_DIM, ax.EMBED), fan_in=n * h),
    )
    if config.qkv_bias:
        weights += (
            Param("q_bias", (n, h), (ax.HEADS, ax.HEAD_DIM), role="bias", init="zeros"),
            Param("k_bias", (k, h), (ax.KV_HEADS, ax.HEAD_DIM), role="bias", init="zeros"),
            Param("v_bias", (k, h), (ax.KV_HEADS, ax.HEAD_DIM), role="bias", init="zeros"),
        )
    if config.qk_norm:
        weights += (
            Param("q_norm", (h,), (ax.HEAD_DIM,), role="scale", init="ones"),
            Param("k_norm", (h,), (ax.HEAD_DIM,), role="scale", init="ones"),
        )
    return weights + adapter_params(weights, config)


def block_params(config: ModelConfig, moe: bool = False) -> tuple[Param, ...]:
    """`models.transformer.Block`, one layer's slice, in creation order: with ``moe`` a mixture-of-experts
    layer (``moe/...`` in place of ``mlp/...``)."""
    d = config.embed_dim
    parts = (
        ("attention_norm", norm_params(d)),
        ("attention", attention_params(config)),
        ("mlp_norm", norm_params(d)),
        ("moe", moe_params(config)) if moe else ("mlp", mlp_params(d, config.mlp_dim, config)),
    )
    return tuple(p.under(prefix) for prefix, table in parts for p in table)


def output_params(config: ModelConfig) -> tuple[Param, ...]:
    """`models.transformer.Transformer`'s own ``unembed [embed, vocab]`` (none when tied)."""
    if config.tie_embeddings:
        return ()
    return (Param("unembed", (config.embed_dim, config.vocab_size), (ax.EMBED, ax.VOCAB), role="output"),)


def _all_params(config: ModelConfig) -> tuple[Param, ...]:
    """Every parameter of `models.transformer.Transformer` with its path, in creation order."""
    return (
        tuple(p.under("embed") for p in embed_params(config.vocab_size, config.embed_dim))
        + tuple(
            p.under(name, per_layer=True, stack=count if config.is_moe else None)
            for name, moe, count in config.layer_stacks()
            for p in block_params(config, moe)
        )
        + tuple(p.under("final_norm") for p in norm_params(config.embed_dim))
        + output_params(config)
    )


# Work and memory per token --------------------------------------------------------------------


def _layer_elementwise(config: ModelConfig) -> tuple[Term, ...]:
    """Elementwise FLOPs per token of one block's forward pass, by op count (XLA counts one FLOP per
    element per arithmetic op; square roots are transcendentals)."""
    d, f, n, k, h = config.embed_dim, config.mlp_dim, config.num_heads, config.num_kv_heads, config.head_dim
    return (
        Term(10.0 * d, what="two RMSNorms (square, mean, scale, multiply: 4 each) and two residual adds"),
        Term(2.0 * f, ax.MLP, what="SwiGLU: silu(gate) * up"),
        Term(3.0 * (n + 2 * k) * h, ax.HEADS, what="rotary positions on queries and keys"),
        Term(6.0 * n, ax.HEADS, per_key=True, what="softmax of the scores (scale, mask, max, subtract, sum, divide)"),
        Term(3.0, per_key=True, what="causal and document mask"),
    ) + ((Term(4.0 * (n + k) * h, ax.HEADS, what="query/key RMSNorms (qk_norm)"),) if config.qk_norm else ())


def _loss_elementwise(config: ModelConfig) -> tuple[Term, ...]:
    return (Term(4.0 * config.vocab_size, ax.VOCAB, what="log-softmax cross-entropy (max, subtract, sum, select)"),)


def _activations(config: ModelConfig) -> tuple[Term, ...]:
    """What autodiff saves per token of one block without remat (elements; bytes None: compute dtype).

    ``kept=("dot",)`` marks what ``remat="dots"`` keeps (`jax.checkpoint_policies.dots_with_no_batch_dims_saveable`):
    the outputs of the products without batch dimensions that the backward pass reads, q, k, v, o, gate and up.
    The score products have batch dimensions (batch, heads) and a Pallas kernel is no product, so the attention
    output is recomputed; down's output feeds only the residual add, whose gradient reads no primal, so it is no
    residual. Checked against the compiled step's temporaries per layer (``tests/test_costmodel.py``).

    The terms named ``act_length`` live in the residual stream, outside the attention and MLP blocks: under
    sequence parallelism they take 1/``tensor`` of their memory (Korthikanti et al., 2022, section 4.2.2). Read
    from the compiled step: ``test`` on ``data=2,tensor=4`` (1,024 tokens a device, float32) saves 387 float32
    elements per token and layer less with the ``tp_sp`` rules than with ``tp``, 4 ``d`` x 3/4 (the block input,
    the attention's output projection, reduce-scattered, and the two norms' float32 copies), and with
    ``remat="dots"`` 192, 2 ``d`` x 3/4 (the two of them it keeps); the norm outputs the products read are
    gathered whole along the length, and saved so.
    """
    d, f, n, k, h = config.embed_dim, config.mlp_dim, config.num_heads, config.num_kv_heads, config.head_dim
    moe = config.num_moe_layers / config.num_layers if config.is_moe else 0.0
    return (
        Term(d, ax.ACT_LENGTH, kept=("input",), what="block input"),
        Term(d, ax.ACT_LENGTH, kept=("dot",), what="attention output projection"),
        Term(4 * d, what="norm outputs and residual branches"),
        Term(n * h, ax.HEADS, kept=("dot",), what="queries (the q product's output)"),
        Term(n * h, ax.HEADS, what="the attention output (not a product without batch dimensions)"),
        Term(2 * k * h, ax.KV_HEADS, kept=("dot",), what="keys and values (the k and v products' outputs)"),
        Term(2 * k * h, ax.KV_HEADS, what="the rotated keys and the values as attention takes them"),
        Term(2 * d, ax.ACT_LENGTH, bytes=4, what="float32 copies inside the two RMSNorms"),
        Term(n, ax.HEADS, per_key=True, bytes=4, what="float32 softmax of the scores"),
        Term(1, per_key=True, bytes=1, what="the boolean mask"),
    ) + tuple(
        dataclasses.replace(t, amount=t.amount * share)
        for terms, share in ((_swiglu_activations(f), 1.0 - moe), (_moe_activations(config), moe))
        if share
        for t in terms
    )


def _residuals(config: ModelConfig) -> tuple[Term, ...]:
    """What ``jax.vjp`` of one dense block saves per token, residual by residual as its jaxpr holds them (bytes
    None: the compute dtype): what a pipeline stage keeps from a layer's forward tick to its backward
    (`sharding.pipeline.split.LayerSplit.kept_avals`), where each residual is an array of its own; the
    whole-step program's fusions recompute some of them (`_activations`, the unpipelined count).

    ``dots`` keeps the block input and the outputs of q, k, v, o, gate and up; ``none`` keeps the input and
    (the tags ``none-*`` name what only some kernels or compute dtypes keep: `sharding.costmodel.pipeline.
    residual_tags` selects them for a layout):

    - each RMSNorm (`models.layers.rms_norm`): its float32 input (the block input itself where the compute
      dtype is float32, else a float32 copy, ``none-low``; after attention, the residual stream ``h + o``,
      which is why o's output is no residual under ``none``), its float32 normalised input (for the scale's gradient), two float32
      scalars per token (the reciprocal root and the mean's gradient factor) and its output as the products
      read it;
    - the attention (`models.attention_reference.reference_attention`, whose custom backward recomputes the
      probabilities: the split runs that recomputation on the forward tick, as it reads no cotangent): the
      rotated queries and keys and the values (the shapes of the q, k, v products' outputs), the float32
      exponentials of the scores ``[heads, keys]`` (and, below float32, as the value product reads them,
      ``none-low``),
      and its output ``[heads * head_dim]`` twice, in float32 as the normalisation gives it (tagged
      ``none-scores``: a kernel that materialises the scores) and as the o product reads it; a tiled kernel
      (flash, tagged ``none-tiled``) keeps no scores but its own residuals, its float32 log-sum-exp
      ``[heads]`` and its output as it accumulates it, in float32 (below float32 an array beside the output
      the o product reads, ``none-tiled-low``; in float32 that one) (`models.kernels.flash_attention`'s residuals; the traced
      split of ``test`` with ``attention=flash``, 2 x 128 tokens, float32 and bfloat16, to the byte);
      with ``qk_norm``, each of those norms' float32 input and normalised input and two scalars per head;
    - the SwiGLU: gate and up, sigmoid(gate), its derivative factor, silu(gate) and the hidden: six ``[F]``.

    Read from the traced split of ``test`` (``D`` 128, ``F`` 384, 4 heads of 32, 2 kv heads; one sequence of
    32 tokens a device): ``none`` 459,264 bytes in float32 (3,588 elements per token) and 295,424 bytes in
    bfloat16, ``dots`` 147,456 bytes in float32 (1,152 per token), each to the byte."""
    d, f, n, k, h = config.embed_dim, config.mlp_dim, config.num_heads, config.num_kv_heads, config.head_dim
    none = ("none",)
    terms = [
        Term(d, ax.ACT_LENGTH, kept=("input",), what="block input"),
        Term(d, ax.ACT_LENGTH, kept=("dot",), what="attention output projection (dots)"),
        Term(n * h, ax.HEADS, kept=("dot", "none"), what="queries (the q product's; none: rotated)"),
        Term(2 * k * h, ax.KV_HEADS, kept=("dot", "none"), what="keys and values (none: the keys rotated)"),
        Term(2 * f, ax.MLP, kept=("dot", "none"), what="gate and up (the products' outputs)"),
        Term(4 * f, ax.MLP, kept=none, what="sigmoid(gate), its derivative factor, silu(gate), the hidden"),
        Term(n * h, ax.HEADS, kept=none, what="the attention output (the o product's input)"),
        Term(n, ax.HEADS, per_key=True, bytes=4, kept=none, what="float32 exp(scores)"),
        Term(
            n * h,
            ax.HEADS,
            bytes=4,
            kept=("none-scores",),
            what="the attention output in float32 (the normalisation's)",
        ),
        Term(n, ax.HEADS, bytes=4, kept=("none-tiled",), what="a tiled kernel's float32 log-sum-exp per head"),
        Term(2 * d, kept=none, what="the two RMSNorms' outputs"),
        Term(2 * d, ax.ACT_LENGTH, bytes=4, kept=none, what="the two RMSNorms' float32 normalised inputs"),
        Term(d, ax.ACT_LENGTH, bytes=4, kept=none, what="norm 2's float32 input (the residual stream h + o)"),
        Term(4, ax.ACT_LENGTH, bytes=4, kept=none, what="the RMSNorms' two float32 scalars per token"),
        # below float32 (the compute dtype's, which the cost model takes from the layout)
        Term(d, ax.ACT_LENGTH, bytes=4, kept=("none-low",), what="norm 1's float32 input (else the block input)"),
        Term(n, ax.HEADS, per_key=True, kept=("none-low",), what="exp(scores) as the value product reads it"),
        Term(n * h, ax.HEADS, bytes=4, kept=("none-tiled-low",), what="a tiled kernel's float32 output"),
    ]
    if config.qk_norm:
        terms.append(Term(2 * (n + k) * (h + 1), ax.HEADS, bytes=4, kept=none, what="query/key RMSNorms'"))
    return tuple(terms)


def _swiglu_activations(f: int) -> tuple[Term, ...]:
    """A SwiGLU of width ``f``'s saved activations per token (`_activations`)."""
    return (
        Term(2 * f, ax.MLP, kept=("dot",), what="gate and up (the products' outputs)"),
        Term(f, ax.MLP, what="hidden, silu(gate) * up"),
    )


def _moe_activations(config: ModelConfig) -> tuple[Term, ...]:
    """A mixture-of-experts layer's saved activations per token (`models.moe`): the router's float32 logits
    (a product without batch dimensions: kept by ``remat="dots"``) and probabilities, the shared experts'
    SwiGLU, and for each routed copy the device computes (``per_copy``: ``K`` per token without expert
    parallelism, ``E_p * min(K, E / E_p)`` per token of its own under the ring, whose gathered rows are
    mostly other devices' experts', `sharding.expert_placement.ExpertPlacement.copies_held`) its row ``[D]``, the
    grouped products' gate and up outputs ``[F]`` (`jax.lax.ragged_dot` is no ``dot_general``: ``dots``
    does not keep them), silu's intermediates, the hidden and the hidden scaled by the combine weight (the
    down product's input): seven ``[F]``, as the bfloat16 step of ``qwen3-30b-a3b`` keeps them (its buffer
    assignment), and its combine weight, sort and scatter indices. Against the compiled step's temporaries
    per layer (``moe-test``, 16 x 512, float32, remat ``none``): ``data=8`` 3,552 float32 elements per token
    compiled, 3,640 priced; ``expert=8`` (the ring's 8 copies per token) 5,259 compiled, 5,392 priced (both
    2.5% over: float32 keeps about six ``[F]``); ``dots`` to the element (328 per token; 264 with ``K`` 4,
    ``F`` 64 and no shared expert)."""
    d, f, e = config.embed_dim, config.expert_dim, config.num_experts
    shared = _swiglu_activations(config.shared_experts * f) if config.shared_experts else ()
    return shared + (
        Term(e, bytes=4, kept=("dot",), what="router logits (float32)"),
        Term(e, bytes=4, what="router probabilities (float32)"),
        Term(d, per_copy=True, what="routed copies' rows"),
        Term(7 * f, ax.MLP, per_copy=True, what="routed gate and up outputs, silu's intermediates, hidden, scaled"),
        Term(4, bytes=4, per_copy=True, what="combine weights, sort and scatter indices"),
    )


@functools.lru_cache(maxsize=64)
def describe(config: ModelConfig) -> ModelDescription:
    """The model of ``config`` as the cost model sees it.

    Args:
      config: The model (only its architecture fields matter).

    Returns:
      The `sharding.modeldesc.ModelDescription`: parameters from the modules' tables, the products
      ``q, k, v, o, gate, up, down`` of a block (``down`` last: full remat does not redo it) and the
      output projection, the attention geometry, elementwise FLOPs and saved activations per token,
      and what each attention kernel of `models.attention_registry.KERNELS` costs (its traits: the
      cost model prices the one a layout names).
    """
    params = _all_params(config)
    by_path = {p.path: p for p in params}

    def product(path, contract, recomputed=True):
        return Product(by_path[path], contract, recomputed)

    layer = [product(f"layers/attention/{n}", (0,)) for n in "qkv"]
    layer.append(product("layers/attention/o", (0, 1)))
    layer += _feed_forward_products(config, by_path)
    logits = product("embed/embedding", (1,)) if config.tie_embeddings else product("unembed", (0,))
    return ModelDescription(
        params=params,
        num_layers=config.num_layers,
        hidden=config.embed_dim,
        products=tuple(layer),
        logits=logits,
        attention=AttentionGeometry(config.num_heads, config.num_kv_heads, config.head_dim),
        layer_elementwise=_layer_elementwise(config),
        loss_elementwise=_loss_elementwise(config),
        activations=_activations(config),
        residuals=() if config.is_moe else _residuals(config),
        attention_kernels=tuple(k.traits for k in KERNELS),
        inactive_params=_inactive_params(config),
        frozen_bytes=2 if config.lora_rank and config.lora_base_dtype == "bfloat16" else 4,
        experts=expert_geometry(config),
    )


def expert_geometry(config: ModelConfig) -> ExpertGeometry | None:
    """The routing of ``config``'s mixture of experts as the cost model and the layout checks read it
    (`sharding.modeldesc.ExpertGeometry`), or None for a dense model."""
    if not config.is_moe:
        return None
    return ExpertGeometry(
        config.num_moe_layers,
        config.num_experts,
        config.experts_per_token,
        config.capacity_factor,
        config.embed_dim,
        config.expert_dim,
    )


def _feed_forward_products(config: ModelConfig, by_path: dict[str, Param]) -> list[Product]:
    """The feed-forward products of one layer, averaged over the layers: a dense model's SwiGLU; for a
    mixture of experts the dense layers' SwiGLU (share: their fraction of the layers), and the router,
    shared experts (share: the mixtures' fraction) and routed experts (times ``k / E``; grouped products over
    the ``E`` experts, `models.moe.expert_outputs`)."""
    if not config.is_moe:
        prefixes = (("layers/mlp", 1.0),)
    else:
        moe = config.num_moe_layers / config.num_layers
        prefixes = (("dense_layers/mlp", 1.0 - moe),) if moe < 1 else ()
        if config.shared_experts:
            prefixes += (("layers/moe/shared", moe),)
    out = []
    for prefix, share in prefixes:
        out += [
            Product(by_path[f"{prefix}/gate"], (0,), share=share),
            Product(by_path[f"{prefix}/up"], (0,), share=share),
            Product(by_path[f"{prefix}/down"], (0,), recomputed=False, share=share),
        ]
    if config.is_moe:
        routed, e = moe * config.experts_per_token / config.num_experts, config.num_experts
        out += [
            Product(by_path["layers/moe/router"], (0,), share=moe),
            Product(by_path["layers/moe/gate"], (1,), share=routed, groups=e),
            Product(by_path["layers/moe/up"], (1,), share=routed, groups=e),
            # recomputed: its output, times the combine weight, gives that weight's (the router's) gradient
            Product(by_path["layers/moe/down"], (1,), share=routed, groups=e),
        ]
    return out


def _inactive_params(config: ModelConfig) -> int:
    """Routed expert parameters a token does not use: ``(E - k) / E`` of them in every MoE layer."""
    if not config.is_moe:
        return 0
    d, f, e, k = config.embed_dim, config.expert_dim, config.num_experts, config.experts_per_token
    return config.num_moe_layers * 3 * d * f * (e - k)
