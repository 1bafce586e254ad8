"""Low-rank adapters on a frozen model (Hu et al., 2021, "LoRA: Low-Rank Adaptation of Large Language
Models", section 4.1).

A target projection ``W [in..., out...]`` (`models.config.LORA_TARGETS`: ``q, k, v [embed, heads,
head_dim]``, ``o [heads, head_dim, embed]``, the SwiGLU's ``gate, up [embed, mlp]`` and ``down [mlp,
embed]``, and a mixture of experts' stacked ``[expert, ...]`` ones) gets two factors, ``W_lora_a [in...,
r]`` and ``W_lora_b [r, out...]``, and the layer computes with ``W + (alpha / r) * A @ B`` (the paper's
``W0 + BA`` with its ``alpha / r`` scaling, section 4.1; its B is our ``A``'s transpose and vice versa: ours
keep the weight's own dimension order). ``A`` starts random (LeCun normal over the input dimensions),
``B`` at zero, so the adapted model starts as the base model exactly.

The factors carry the base weight's logical names for the dimensions they share with it (``A`` its input
dimensions, ``B`` its output ones, an expert stack its ``expert``) and `sharding.axes.LORA_RANK` (no rule
maps it: whole on every device) for the rank, so the rules lay them out as the weight they adapt.

The sum is formed per layer inside the layer (`weight`), so under the scanned stack only one layer's
adapted weights exist at a time and their gradient is contracted into the factors' inside the layer's
backward pass. Only the factors are trained (`trainable`): the train state keeps no optimizer state and
computes no gradient for the rest.

Einsum letters here: ``I`` the input dimensions, ``R`` the rank, ``O`` the output dimensions, ``E`` leading
stack dimensions (layers, experts).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp

from models.config import LORA_SUFFIXES, ModelConfig
from sharding import axes as ax
from sharding.modeldesc import Param

A_SUFFIX, B_SUFFIX = LORA_SUFFIXES

_INPUTS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}
"""How many leading dimensions of each target weight (after an expert stack's) are its input dimensions."""


def targets(config: ModelConfig) -> tuple[str, ...]:
    """The projections that carry adapters (empty without adapters)."""
    if not config.lora_rank:
        return ()
    return tuple(t.strip() for t in config.lora_targets.split(",") if t.strip())


def scale(config: ModelConfig) -> float:
    """``lora_alpha / lora_rank``, the factor on ``A @ B`` (Hu et al. 2021, section 4.1)."""
    return config.lora_alpha / config.lora_rank


def adapter_params(table: tuple[Param, ...], config: ModelConfig) -> tuple[Param, ...]:
    """The adapter factors of a module's parameter table (`models.spec`), in the table's order.

    Args:
      table: The module's parameters, e.g. `models.spec.attention_params` (paths relative to the module).
      config: The model; its ``lora_rank`` and ``lora_targets`` say which weights get factors.

    Returns:
      For each target weight ``W`` of ``table``: ``W_lora_a [stack..., in..., rank]`` (role ``adapter``,
      LeCun normal over the inputs) and ``W_lora_b [stack..., rank, out...]`` (zeros); empty without adapters.
    """
    chosen, r = targets(config), config.lora_rank
    out = []
    for p in table:
        if p.name not in chosen or p.name not in _INPUTS:
            continue
        lead = 1 if p.axes[0] == ax.EXPERT else 0
        cut = lead + _INPUTS[p.name]
        stack_shape, stack_axes = p.shape[:lead], p.axes[:lead]
        out.append(
            Param(
                p.path + A_SUFFIX,
                stack_shape + p.shape[lead:cut] + (r,),
                stack_axes + p.axes[lead:cut] + (ax.LORA_RANK,),
                role="adapter",
                fan_in=math.prod(p.shape[lead:cut]),
            )
        )
        out.append(
            Param(
                p.path + B_SUFFIX,
                stack_shape + (r,) + p.shape[cut:],
                stack_axes + (ax.LORA_RANK,) + p.axes[cut:],
                role="adapter",
                init="zeros",
            )
        )
    return tuple(out)


def product(a: jax.Array, b: jax.Array, inputs: int) -> jax.Array:
    """``A @ B`` over the rank: ``a [E..., I..., R]`` and ``b [E..., R, O...]`` -> ``[E..., I..., O...]``,
    float32 (``inputs``: how many ``I`` dimensions; the leading ``E`` stack dimensions pair up)."""
    stack = a.ndim - inputs - 1
    outputs = b.ndim - stack - 1
    e, i, o = "abcd"[:stack], "ijkl"[:inputs], "uvwx"[:outputs]
    return jnp.einsum(f"{e}{i}r,{e}r{o}->{e}{i}{o}", a.astype(jnp.float32), b.astype(jnp.float32))


def adapted(w: jax.Array, a: jax.Array, b: jax.Array, name: str, factor: float) -> jax.Array:
    """``w + factor * A @ B`` in float32 (`product`), ``w`` shaped ``[E..., I..., O...]`` as weight ``name``."""
    return w.astype(jnp.float32) + factor * product(a, b, _INPUTS[name])


def weight(module: Any, name: str) -> jax.Array:
    """The weight ``name`` of a module as its layer computes with it: the parameter itself, or with adapters
    ``W + lora_scale * A @ B`` (float32), ``lora_scale`` the module's attribute (`scale`)."""
    w = getattr(module, name)[...]
    a = getattr(module, name + A_SUFFIX, None)
    if a is None:
        return w
    return adapted(w, a[...], getattr(module, name + B_SUFFIX)[...], name, module.lora_scale)


def held_in_dtype(config: ModelConfig, tree: dict) -> dict:
    """A parameter tree (arrays or `jax.ShapeDtypeStruct`s) with the frozen base in the dtype the model holds it
    in (``lora_base_dtype``: float32, or bfloat16 to halve its bytes); the factors, and every parameter of a
    model without adapters, as they are (float32). Layers widen a weight to the compute dtype as they use it
    (`weight`, and each layer's ``astype``), so a bfloat16 base computes as its values widened to float32."""
    if not config.lora_rank or config.lora_base_dtype == "float32":
        return tree
    dtype = jnp.dtype(config.lora_base_dtype)

    def cast(key, x):
        if is_adapter(key):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, dtype, sharding=x.sharding)
        return x.astype(dtype)

    def walk(node):
        return {k: walk(v) if isinstance(v, dict) else cast(str(k), v) for k, v in node.items()}

    return walk(tree)


def is_adapter(key: str) -> bool:
    """Whether a parameter tree key names an adapter factor."""
    return key.endswith(A_SUFFIX) or key.endswith(B_SUFFIX)


def trainable(config: ModelConfig, tree: dict) -> dict:
    """The part of a tree shaped as the parameters that training updates: all of it without adapters, else
    only the adapter factors (the same nesting, other leaves left out)."""
    if not config.lora_rank:
        return tree

    def pick(node):
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                sub = pick(value)
                if sub:
                    out[key] = sub
            elif is_adapter(str(key)):
                out[key] = value
        return out

    return pick(tree)


def with_trainable(config: ModelConfig, tree: dict, part: dict) -> dict:
    """``tree`` with the leaves of ``part`` (`trainable`'s shape) put in; ``part`` itself without adapters."""
    if not config.lora_rank:
        return part

    def put(node, sub):
        out = dict(node)
        for key, value in sub.items():
            out[key] = put(node[key], value) if isinstance(value, dict) else value
        return out

    return put(tree, part)


def merged(config: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """The model without adapters whose weights are the adapted ones: ``(config, params)`` with each target
    ``W + scale * A @ B`` (float32) and the factors removed, every stack dimension (layers, experts) kept;
    the config names no adapter field (a base held in bfloat16 included: without adapters none is).

    Args:
      config: A model with adapters.
      params: Its parameters (a nested dict of arrays), any stacked layout.
    """
    factor = scale(config)

    def fold(node):
        out = {}
        for key, value in node.items():
            if isinstance(value, dict):
                out[key] = fold(value)
            elif not is_adapter(key):
                a = node.get(key + A_SUFFIX)
                out[key] = value if a is None else adapted(value, a, node[key + B_SUFFIX], key, factor)
        return out

    return config.replace(lora_rank=0, lora_targets="", lora_base_dtype="float32"), fold(params)
