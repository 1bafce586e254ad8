"""The Hugging Face architecture families meshwork reads and writes: one table of tensors each.

`family` names the architecture a `ModelConfig` is exported as (`check_exportable` refuses one no family
holds); `tensor_maps` lists every parameter with its Hugging Face tensor(s) as `TensorMap` records, which
`checkpoints.hf` reads (`read_block`: one device's block of a tensor, reading only its rows and columns)
and writes.

Tensor names and layouts (``transformers``' Llama modules are the contract; einsum letters as in
`models.attention`: D embed, N heads, K kv heads, H head_dim, F mlp, V vocab, L layers)::

    model.embed_tokens.weight                  [V, D]     embed/embedding            [V, D]
    lm_head.weight (untied)                    [V, D]     unembed                    [D, V]   (transposed)
    model.norm.weight                          [D]        final_norm/scale           [D]
    model.layers.{i}.input_layernorm.weight    [D]        layers/attention_norm/scale [L, D]
    model.layers.{i}.post_attention_layernorm  [D]        layers/mlp_norm/scale      [L, D]
    model.layers.{i}.self_attn.q_proj.weight   [N*H, D]   layers/attention/q         [L, D, N, H]
    model.layers.{i}.self_attn.k_proj.weight   [K*H, D]   layers/attention/k         [L, D, K, H]
    model.layers.{i}.self_attn.v_proj.weight   [K*H, D]   layers/attention/v         [L, D, K, H]
    model.layers.{i}.self_attn.o_proj.weight   [D, N*H]   layers/attention/o         [L, N, H, D]
    model.layers.{i}.self_attn.q_proj.bias     [N*H]      layers/attention/q_bias    [L, N, H]  (Qwen2)
    model.layers.{i}.self_attn.{k,v}_proj.bias [K*H]      layers/attention/{k,v}_bias [L, K, H] (Qwen2)
    model.layers.{i}.mlp.gate_proj.weight      [F, D]     layers/mlp/gate            [L, D, F]
    model.layers.{i}.mlp.up_proj.weight        [F, D]     layers/mlp/up              [L, D, F]
    model.layers.{i}.mlp.down_proj.weight      [D, F]     layers/mlp/down            [L, F, D]

Mixtral (``MixtralForCausalLM``: every layer a mixture of E experts, top-k, renormalised softmax weights;
E experts, F one expert's width)::

    model.layers.{i}.block_sparse_moe.gate.weight             [E, D]  layers/moe/router  [L, D, E]
    model.layers.{i}.block_sparse_moe.experts.{j}.w1.weight   [F, D]  layers/moe/gate    [L, E, D, F]
    model.layers.{i}.block_sparse_moe.experts.{j}.w3.weight   [F, D]  layers/moe/up      [L, E, D, F]
    model.layers.{i}.block_sparse_moe.experts.{j}.w2.weight   [D, F]  layers/moe/down    [L, E, F, D]

(with ``post_attention_layernorm`` -> ``layers/mlp_norm/scale`` as for Llama).

Qwen3-MoE (``Qwen3MoeForCausalLM``: query/key RMSNorms, softmax top-k routing renormalised when
``norm_topk_prob``, no shared expert; the layers in ``mlp_only_layers`` and those whose ``i + 1`` is not a
multiple of ``decoder_sparse_step`` are dense SwiGLUs of ``intermediate_size``, the others mixtures of
experts of ``moe_intermediate_size``)::

    model.layers.{i}.self_attn.q_norm.weight               [H]     layers/attention/q_norm  [L, H]
    model.layers.{i}.self_attn.k_norm.weight               [H]     layers/attention/k_norm  [L, H]
    model.layers.{i}.mlp.gate.weight                       [E, D]  layers/moe/router  [L, D, E]
    model.layers.{i}.mlp.experts.{j}.gate_proj.weight      [F, D]  layers/moe/gate    [L, E, D, F]
    model.layers.{i}.mlp.experts.{j}.up_proj.weight        [F, D]  layers/moe/up      [L, E, D, F]
    model.layers.{i}.mlp.experts.{j}.down_proj.weight      [D, F]  layers/moe/down    [L, E, F, D]

(dense layers as Llama's, in the ``dense_layers/...`` stack; `Qwen3ForCausalLM` is the dense family with
the query/key norms). These are the per-expert names ``save_pretrained`` writes (its default
``save_original_format``) and the published checkpoints use; the fused ``experts.gate_up_proj`` layout of
``save_original_format=False`` is not read. Qwen2-MoE is not read: its gated shared expert is not in
meshwork's model.

Every mapping is a reshape and a transpose: ``transformers``' ``rotate_half`` pairs rotary
dimension ``i`` with ``i + H/2``, as `models.layers.rotary_embedding` does, so no permutation of
the query/key rows is needed (the Meta-to-Hugging Face conversion's interleave permutation
applies only to Meta's original checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import numpy as np

from models.config import ModelConfig

MODEL_TYPES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MixtralForCausalLM": "mixtral",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
"""``config.json``'s ``model_type`` of each architecture."""


def family(config: ModelConfig) -> str:
    """The Hugging Face architecture `config` is exported as: a mixture of experts is ``Qwen3MoeForCausalLM``
    with ``qk_norm``, else ``MixtralForCausalLM``; a dense model ``Qwen3ForCausalLM`` with ``qk_norm``,
    ``Qwen2ForCausalLM`` with ``qkv_bias``, else ``LlamaForCausalLM``.

    Raises:
      ValueError: a model that family cannot hold, naming the field (`check_exportable`).
    """
    check_exportable(config)
    if config.is_moe:
        return "Qwen3MoeForCausalLM" if config.qk_norm else "MixtralForCausalLM"
    if config.qk_norm:
        return "Qwen3ForCausalLM"
    return "Qwen2ForCausalLM" if config.qkv_bias else "LlamaForCausalLM"


def check_exportable(config: ModelConfig) -> None:
    """Raises ValueError when no Hugging Face family holds `config`'s architecture, naming the field.

    Qwen3 has query/key norms and no query/key/value biases. A mixture of experts is written as Mixtral (no
    ``qk_norm``: every layer a mixture, renormalised softmax weights) or as Qwen3-MoE (``qk_norm``: dense
    layers as ``mlp_only_layers`` and ``decoder_sparse_step``, so ``first_dense_layers`` must be a multiple of
    ``moe_every``); both have no shared experts, softmax routing and no routed scale.
    """
    if config.qk_norm and config.qkv_bias:
        raise ValueError("qkv_bias=True: a model with qk_norm is exported as Qwen3, which needs qkv_bias=False")
    if not config.is_moe:
        return
    if config.qk_norm:
        name = "Qwen3MoeForCausalLM"
        wanted = {"shared_experts": 0, "router": "softmax", "routed_scale": 1.0}
        if config.first_dense_layers % config.moe_every:
            raise ValueError(
                f"first_dense_layers={config.first_dense_layers}: a mixture of experts with qk_norm is exported as "
                f"{name}, whose decoder_sparse_step puts the MoE layers at multiples of moe_every="
                f"{config.moe_every}; needs first_dense_layers a multiple of moe_every"
            )
    else:
        name = "MixtralForCausalLM"
        wanted = {
            "first_dense_layers": 0,
            "moe_every": 1,
            "shared_experts": 0,
            "router": "softmax",
            "norm_topk": True,
            "routed_scale": 1.0,
            "qkv_bias": False,
        }
    for field, value in wanted.items():
        if getattr(config, field) != value:
            raise ValueError(
                f"{field}={getattr(config, field)}: a mixture of experts is exported as {name}, which needs "
                f"{field}={value}" + ("" if config.qk_norm else " (or qk_norm=True for Qwen3MoeForCausalLM)")
            )


@dataclasses.dataclass(frozen=True)
class TensorMap:
    """One meshwork parameter and the Hugging Face tensor(s) it holds.

    Attributes:
      path: the parameter's keys in meshwork's params tree, e.g. ``("layers", "attention", "q")``.
      hf_name: the tensor's name; ``{i}`` stands for the layer of a stacked parameter.
      split: for each dimension of the Hugging Face tensor, the sizes of meshwork's dimensions it
        holds (``[N*H, D]`` -> ``((N, H), (D,))``).
      perm: meshwork's (per-layer) array is the Hugging Face tensor reshaped to the flattened
        ``split`` and transposed by ``perm``.
      stacked: one tensor per layer, stacked on meshwork's leading ``layers`` dimension.
      layers: for a stacked parameter, the Hugging Face layer index ``{i}`` of each row of its stack (a
        mixture of experts keeps its dense and MoE layers in two stacks); None: ``0 .. num_layers-1``.
      experts: E > 0: one tensor per expert ``{j}``, stacked on meshwork's ``expert`` dimension (after
        ``layers``).
    """

    path: tuple[str, ...]
    hf_name: str
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]
    stacked: bool = False
    layers: tuple[int, ...] | None = None
    experts: int = 0

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(group) for group in self.split)

    @property
    def shape(self) -> tuple[int, ...]:
        """meshwork's per-layer shape."""
        flat = [size for group in self.split for size in group]
        return tuple(flat[p] for p in self.perm)

    def layer_ids(self, num_layers: int) -> tuple[int, ...]:
        """The Hugging Face layer of each row of the stack."""
        return tuple(range(num_layers)) if self.layers is None else self.layers

    def lead(self, num_layers: int) -> tuple[int, ...]:
        """meshwork's leading dimensions before the per-tensor ones: ``[layers]`` and ``[experts]``."""
        return ((len(self.layer_ids(num_layers)),) if self.stacked else ()) + ((self.experts,) if self.experts else ())

    def entries(self, num_layers: int) -> list[tuple[str, tuple[int, ...]]]:
        """``(Hugging Face name, index into meshwork's leading dimensions)`` of every tensor held."""
        if not self.stacked:
            return [(self.hf_name, ())]
        out = []
        for row, i in enumerate(self.layer_ids(num_layers)):
            if self.experts:
                out += [(self.hf_name.format(i=i, j=j), (row, j)) for j in range(self.experts)]
            else:
                out.append((self.hf_name.format(i=i), (row,)))
        return out

    def names(self, num_layers: int) -> list[str]:
        """The Hugging Face names this parameter holds (one per layer, and expert, when stacked)."""
        return [name for name, _ in self.entries(num_layers)]


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every parameter of `config`'s model with its Hugging Face tensor (module docstring's tables)."""
    kinds = np.asarray(config.layer_kinds())
    maps = []
    for stack, moe, _ in config.layer_stacks():
        rows = tuple(int(i) for i in np.flatnonzero(kinds == moe)) if config.is_moe else None
        maps += [
            dataclasses.replace(m, path=(stack, *m.path[1:]), layers=rows) if m.stacked else m
            for m in _llama_maps(config, moe)
        ]
    return _dedupe(maps)


def _dedupe(maps: list[TensorMap]) -> list[TensorMap]:
    """``maps`` with the unstacked entries (embedding, final norm, output) kept once: each stack lists them."""
    seen, out = set(), []
    for m in maps:
        key = (m.path, m.hf_name)
        if key not in seen:
            seen.add(key)
            out.append(m)
    return out


def _llama_maps(config: ModelConfig, moe: bool = False) -> list[TensorMap]:
    """The Llama (and Mistral, Qwen2, Qwen3) table, with Mixtral's or Qwen3-MoE's feed-forward where ``moe``."""
    d, n, k, h, f, v = (
        config.embed_dim,
        config.num_heads,
        config.num_kv_heads,
        config.head_dim,
        config.mlp_dim,
        config.vocab_size,
    )
    layer = "model.layers.{i}."
    maps = [TensorMap(("embed", "embedding"), "model.embed_tokens.weight", ((v,), (d,)), (0, 1))]
    for name, hf_name in (("attention_norm", "input_layernorm"), ("mlp_norm", "post_attention_layernorm")):
        maps.append(TensorMap(("layers", name, "scale"), f"{layer}{hf_name}.weight", ((d,),), (0,), True))
    for name, heads in (("q", n), ("k", k), ("v", k)):
        maps.append(
            TensorMap(
                ("layers", "attention", name),
                f"{layer}self_attn.{name}_proj.weight",
                ((heads, h), (d,)),
                (2, 0, 1),
                True,
            )
        )
        if config.qkv_bias:
            maps.append(
                TensorMap(
                    ("layers", "attention", f"{name}_bias"),
                    f"{layer}self_attn.{name}_proj.bias",
                    ((heads, h),),
                    (0, 1),
                    True,
                )
            )
    if config.qk_norm:
        for name in ("q_norm", "k_norm"):
            maps.append(
                TensorMap(("layers", "attention", name), f"{layer}self_attn.{name}.weight", ((h,),), (0,), True)
            )
    maps.append(
        TensorMap(("layers", "attention", "o"), f"{layer}self_attn.o_proj.weight", ((d,), (n, h)), (1, 2, 0), True)
    )
    if moe:
        e, f = config.num_experts, config.expert_dim
        qwen = config.qk_norm  # Qwen3-MoE's names, else Mixtral's (`family`)
        sparse = f"{layer}mlp." if qwen else f"{layer}block_sparse_moe."
        maps.append(TensorMap(("layers", "moe", "router"), f"{sparse}gate.weight", ((e,), (d,)), (1, 0), True))
        for name, hf_name, split in (
            ("gate", "gate_proj" if qwen else "w1", ((f,), (d,))),
            ("up", "up_proj" if qwen else "w3", ((f,), (d,))),
            ("down", "down_proj" if qwen else "w2", ((d,), (f,))),
        ):
            maps.append(
                TensorMap(
                    ("layers", "moe", name),
                    sparse + "experts.{j}." + f"{hf_name}.weight",
                    split,
                    (1, 0),
                    True,
                    experts=e,
                )
            )
    else:
        for name in ("gate", "up"):
            maps.append(
                TensorMap(("layers", "mlp", name), f"{layer}mlp.{name}_proj.weight", ((f,), (d,)), (1, 0), True)
            )
        maps.append(TensorMap(("layers", "mlp", "down"), f"{layer}mlp.down_proj.weight", ((d,), (f,)), (1, 0), True))
    maps.append(TensorMap(("final_norm", "scale"), "model.norm.weight", ((d,),), (0,)))
    if not config.tie_embeddings:
        maps.append(TensorMap(("unembed",), "lm_head.weight", ((v,), (d,)), (1, 0)))
    return maps


def read_block(get_slice: Callable, m: TensorMap, index: Sequence[slice]) -> np.ndarray:
    """meshwork's block ``index`` (per-layer dims) of one Hugging Face tensor, reading only its rows/columns.

    A Hugging Face dimension holding several of meshwork's (``N*H``) is read over the rows of the
    first one's range with the others whole, then reshaped and sliced.
    """
    flat_index: list[slice] = [slice(None)] * len(m.perm)
    for j, p in enumerate(m.perm):
        flat_index[p] = index[j]
    hf_index, shape, after = [], [], []
    offset = 0
    for group in m.split:
        first = flat_index[offset]
        inner = math.prod(group[1:])
        hf_index.append(slice(first.start * inner, first.stop * inner))
        shape.extend([first.stop - first.start, *group[1:]])
        after.extend([slice(None), *flat_index[offset + 1 : offset + len(group)]])
        offset += len(group)
    block = np.asarray(get_slice()[tuple(hf_index)])
    return block.reshape(shape)[tuple(after)].transpose(m.perm)
