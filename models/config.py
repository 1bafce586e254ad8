"""Model configuration and named presets.

`ModelConfig` describes a decoder-only LM (Llama-style: RMSNorm, rotary
positions, SwiGLU MLP, grouped-query attention). Its *architecture* fields fix
the parameters; its *execution* fields (dtype, remat, attention, logits) only change
how a step computes, so a checkpoint restores under any of them.

Parameter count (untied embeddings), with V vocab_size, D embed_dim, L
num_layers, N num_heads, K num_kv_heads, H head_dim, F mlp_dim::

    P = 2*V*D                        # token embedding + output projection
      + L * (2*D*N*H + 2*D*K*H       # attention: q, o and k, v
             + 3*D*F                 # SwiGLU: gate, up, down
             + 2*D)                  # two RMSNorm scales per layer
      + D                            # final RMSNorm

(with tied embeddings the first term is V*D; with ``qkv_bias`` each layer adds N*H + 2*K*H, with
``qk_norm`` 2*H).
`ModelConfig.num_params` computes exactly this (from `models.spec`, the tables that build the
modules); start-up checks it against the built model.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
from collections.abc import Iterable
from typing import Any

from models import attention_registry
from sharding.errors import ConfigError, Field, Override

DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots")
LOGITS_IMPLS = ("auto", "gathered", "vocab_parallel")  # sharding.vocab.OUTPUT_IMPLS
ROPE_TYPES = ("default", "llama3")
ROUTERS = ("softmax", "sigmoid")
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
"""The projections low-rank adapters may target (`models.lora`): attention's four, the SwiGLU's three."""
LORA_SUFFIXES = ("_lora_a", "_lora_b")
"""A target weight ``W``'s adapter factors are the parameters ``W_lora_a`` and ``W_lora_b`` beside it."""


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only LM.

    Attributes:
      vocab_size: V, tokens in the vocabulary (embedding rows).
      num_layers: L, transformer blocks (stacked on the ``layers`` axis).
      embed_dim: D, model width.
      mlp_dim: F, SwiGLU hidden width.
      num_heads: N, query heads.
      num_kv_heads: K, key/value heads (grouped-query attention; N % K == 0).
      head_dim: H, width of one head.
      rope_theta: base of the rotary frequencies (Su et al., RoFormer, 2021).
      rope_type: ``default`` (the frequencies ``rope_theta ** (-2i / head_dim)``) or ``llama3``
        (Llama 3.1's rescaling of the low frequencies; `models.layers.rope_frequencies`).
      rope_factor: ``llama3``: how much the longest wavelengths are stretched.
      rope_low_freq_factor, rope_high_freq_factor: ``llama3``: wavelengths above
        ``rope_original_max_positions / rope_low_freq_factor`` are divided by ``rope_factor``,
        those below ``rope_original_max_positions / rope_high_freq_factor`` are kept, and those
        between are interpolated.
      rope_original_max_positions: ``llama3``: the context length the model was pre-trained with.
      max_positions: the longest sequence the model is meant for (tokens); informational
        (Hugging Face ``max_position_embeddings``), it changes no computation.
      norm_eps: RMSNorm epsilon.
      tie_embeddings: use the token embedding as the output projection.
      qkv_bias: add a learned bias to the query, key and value projections (Qwen2).
      qk_norm: RMSNorm each query and key head over ``head_dim`` (one learned scale ``[head_dim]`` for
        the queries, one for the keys, shared by the heads) before the rotary positions (Qwen3; Dehghani
        et al., "Scaling Vision Transformers to 22 Billion Parameters", 2023, section 3.2).
      dtype: compute dtype, ``float32`` or ``bfloat16`` (parameters stay
        float32; softmax and loss are float32).
      remat: rematerialisation of each block in the backward pass: ``none``,
        ``full`` (save only block inputs) or ``dots`` (save matmul outputs
        without batch dimensions).
      attention: attention implementation, one of `models.attention_registry.KERNELS` (each record
        says what it is): ``reference`` (einsum + mask), ``flash`` (Pallas FlashAttention-2 under
        ``shard_map``; memory linear in length), or, with the length split over the ``sequence``
        mesh axis (context parallelism), ``ring`` (ring attention, Liu et al. 2023: key/value
        blocks passed around the devices; zigzag layout for causal balance) or ``ulysses``
        (all-to-all attention, Jacobs et al. 2023: heads must divide by the ``sequence`` size), or
        ``dot_product`` (``jax.nn.dot_product_attention``, JAX's own implementation, for comparison).
      logits: how the training loss computes the output projection and cross-entropy
        (`models.output`): ``gathered`` (the weight gathered, logits partitioned by GSPMD),
        ``vocab_parallel`` (Megatron-LM's vocabulary-parallel cross-entropy over the axes that
        split the weight, under ``shard_map``) or ``auto`` (vocab_parallel where it moves fewer
        bytes; `sharding.vocab`).
      num_experts: E, routed experts of each mixture-of-experts layer (`models.moe`); 0: a dense model.
      experts_per_token: k, experts each token is sent to (top-k of the router's scores).
      moe_mlp_dim: SwiGLU hidden width of one expert (0: ``mlp_dim``).
      shared_experts: experts every token passes through besides its routed ones (DeepSeek-MoE),
        held as one SwiGLU of width ``shared_experts * moe_mlp_dim``; 0: none.
      moe_every: every ``moe_every``-th layer after the first dense ones is a mixture of experts, the
        others dense (Qwen2-MoE's ``decoder_sparse_step``); 1: all.
      first_dense_layers: the first layers are dense (DeepSeek-V3's ``first_k_dense_replace``).
      router: ``softmax`` (Mixtral, Qwen3-MoE: top-k of the softmax over experts) or ``sigmoid``
        (DeepSeek-V3: top-k of per-expert sigmoid scores).
      norm_topk: renormalise the k chosen weights to sum to one (Mixtral always; Qwen3-MoE's
        ``norm_topk_prob``; DeepSeek-V3 with sigmoid scores).
      routed_scale: factor on the routed experts' output (DeepSeek-V3's ``routed_scaling_factor``).
      router_aux_coef: weight of the load-balancing loss (Switch Transformer form, mean over MoE layers)
        in the training objective.
      router_z_coef: weight of the router z-loss (ST-MoE) in the training objective.
      capacity_factor: 0: dropless (every token reaches its k experts). Else each expert takes at most
        ``ceil(capacity_factor * tokens * k / E)`` of the tokens one device routes; the rest are dropped
        (their routed output is zero) and counted.
      lora_rank: r of the low-rank adapters (`models.lora`, Hu et al. 2021); 0: none. With adapters only
        they are trained; every other parameter is frozen.
      lora_alpha: the adapters' scale numerator: a target weight acts as ``W + (lora_alpha / lora_rank) * A @ B``.
      lora_targets: comma-separated projections that get adapters, of `models.lora.TARGETS`
        (``q,k,v,o,gate,up,down``; ``gate,up,down`` include a mixture of experts' routed and shared experts).
      lora_base_dtype: with adapters, the dtype the frozen base's parameters are held in, ``float32`` or
        ``bfloat16`` (half the bytes; each layer widens them as it computes); the factors stay float32.
    """

    vocab_size: int
    num_layers: int
    embed_dim: int
    mlp_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rope_type: str = "default"
    rope_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    max_positions: int = 8192
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    qk_norm: bool = False
    dtype: str = "float32"
    remat: str = "none"
    attention: str = "reference"
    logits: str = "auto"
    num_experts: int = 0
    experts_per_token: int = 2
    moe_mlp_dim: int = 0
    shared_experts: int = 0
    moe_every: int = 1
    first_dense_layers: int = 0
    router: str = "softmax"
    norm_topk: bool = True
    routed_scale: float = 1.0
    router_aux_coef: float = 0.01
    router_z_coef: float = 0.0
    capacity_factor: float = 0.0
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: str = ""
    lora_base_dtype: str = "float32"

    ARCHITECTURE_FIELDS = (
        "vocab_size",
        "num_layers",
        "embed_dim",
        "mlp_dim",
        "num_heads",
        "num_kv_heads",
        "head_dim",
        "rope_theta",
        "rope_type",
        "rope_factor",
        "rope_low_freq_factor",
        "rope_high_freq_factor",
        "rope_original_max_positions",
        "norm_eps",
        "tie_embeddings",
        "qkv_bias",
        "qk_norm",
        "num_experts",
        "experts_per_token",
        "moe_mlp_dim",
        "shared_experts",
        "moe_every",
        "first_dense_layers",
        "router",
        "norm_topk",
        "routed_scale",
        "lora_rank",
        "lora_alpha",
        "lora_targets",
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises `sharding.errors.ConfigError` naming the field (as an `Override`, ``FIELD=VALUE``) that is invalid."""
        for name in ("vocab_size", "num_layers", "embed_dim", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ConfigError(Override(name, getattr(self, name)), ": must be a positive integer")
        for name, example in (("rope_theta", 10000.0), ("norm_eps", 1e-5)):  # -1 makes NaN rotations; NaN spreads
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ConfigError(
                    Override(name, value), ": must be a finite number > 0, e.g. ", Override(name, f"{example:g}")
                )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (grouped-query "
                "attention shares each KV head among num_heads / num_kv_heads query heads); ",
                Override("num_heads"),
                " or ",
                Override("num_kv_heads"),
                " to values where it is, e.g. ",
                Override("num_kv_heads", self.num_heads),
            )
        if self.head_dim % 2:
            raise ConfigError(Override("head_dim", self.head_dim), ": rotary embeddings need an even head_dim")
        if self.rope_type == "llama3":
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ConfigError(
                    Override("rope_low_freq_factor", self.rope_low_freq_factor),
                    f" with rope_high_freq_factor={self.rope_high_freq_factor}: need 0 < low < high, e.g. 1 and 4 "
                    "(Llama 3.1)",
                )
            for name, example in (("rope_factor", 8), ("rope_original_max_positions", 8192)):
                if getattr(self, name) <= 0:
                    raise ConfigError(
                        Override(name, getattr(self, name)), f": must be positive, e.g. {example} (Llama 3.1)"
                    )
        checks = (
            ("dtype", DTYPES),
            ("remat", REMAT_POLICIES),
            ("attention", attention_registry.names()),
            ("logits", LOGITS_IMPLS),
            ("rope_type", ROPE_TYPES),
            ("router", ROUTERS),
            ("lora_base_dtype", DTYPES),
        )
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ConfigError(
                    Override(name, getattr(self, name)),
                    f": choose one of {', '.join(allowed)}; e.g. ",
                    Override(name, next(iter(allowed))),
                )
        self._validate_attention()
        self._validate_moe()
        self._validate_lora()

    def _validate_lora(self) -> None:
        """The adapter fields (`models.lora`), each refused naming its field."""
        if self.lora_rank < 0:
            raise ConfigError(
                Field("lora_rank", self.lora_rank), ": must be >= 0 (0: no adapters), e.g. ", Field("lora_rank", 16)
            )
        if not self.lora_rank:
            if self.lora_base_dtype != "float32":
                raise ConfigError(
                    Field("lora_base_dtype", self.lora_base_dtype),
                    " needs adapters (without them every parameter is trained, in float32); add ",
                    Field("lora_rank", 16),
                )
            if self.lora_targets:
                raise ConfigError(
                    Field("lora_targets", self.lora_targets),
                    " needs adapters of some rank, e.g. ",
                    Field("lora_rank", 16),
                )
            return
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise ConfigError(
                Field("lora_alpha", self.lora_alpha), ": must be a finite number > 0, e.g. ", Field("lora_alpha", 16)
            )
        if self.lora_rank > self.embed_dim:  # every target has embed_dim on one side: A @ B gains no rank past it
            raise ConfigError(
                Field("lora_rank", self.lora_rank),
                f": above the model width {self.embed_dim} (embed_dim) an adapter gains no rank, only memory, e.g. ",
                Field("lora_rank", min(16, self.embed_dim)),
            )
        names = [t.strip() for t in self.lora_targets.split(",") if t.strip()]
        bad = [t for t in names if t not in LORA_TARGETS]
        if bad or not names or len(set(names)) != len(names):
            raise ConfigError(
                Field("lora_targets", self.lora_targets or "''"),
                f": a comma-separated list of distinct projections of {','.join(LORA_TARGETS)}, e.g. ",
                Field("lora_targets", "q,v"),
            )

    def _validate_attention(self) -> None:
        """What the attention kernel's record (`models.attention_registry.AttentionKernel`) says it takes: the
        compute dtype and head_dim, each refused naming its field and a value that works."""
        record = attention_registry.kernel(self.attention)
        if record.dtypes and self.dtype not in record.dtypes:
            raise ConfigError(
                Field("attention", record.name),
                f" takes {' or '.join(record.dtypes)} only, not ",
                Field("dtype", self.dtype),
                "; use ",
                Field("attention", "flash"),
                ", or ",
                Field("dtype", record.dtypes[0]),
                " where it runs",
            )
        limit = record.max_head_dim or self.head_dim
        if self.head_dim % record.head_dim_multiple or self.head_dim > limit:
            good = min(limit, -(-self.head_dim // record.head_dim_multiple) * record.head_dim_multiple)
            raise ConfigError(
                Field("attention", record.name),
                f" takes a head_dim that is a multiple of {record.head_dim_multiple}"
                + (f" and at most {record.max_head_dim}" if record.max_head_dim else "")
                + ", not ",
                Override("head_dim", self.head_dim),
                "; use ",
                Field("attention", "flash"),
                ", or ",
                Override("head_dim", good),
            )

    def _validate_moe(self) -> None:
        """The mixture-of-experts fields (`models.moe`), each refused naming its field (an `Override`)."""
        for name in ("num_experts", "moe_mlp_dim", "shared_experts", "first_dense_layers"):
            if getattr(self, name) < 0:
                raise ConfigError(Override(name, getattr(self, name)), ": must be >= 0, e.g. ", Override(name, 0))
        for name, example in (("router_aux_coef", 0.01), ("router_z_coef", 0.001), ("capacity_factor", 1.25)):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(
                    Override(name, value), ": must be a finite number >= 0, e.g. ", Override(name, f"{example:g}")
                )
        if not self.num_experts:
            return
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ConfigError(
                Override("experts_per_token", self.experts_per_token),
                f": must be between 1 and num_experts={self.num_experts}, e.g. ",
                Override("experts_per_token", min(2, self.num_experts)),
            )
        if not (math.isfinite(self.routed_scale) and self.routed_scale > 0):
            raise ConfigError(Override("routed_scale", self.routed_scale), ": must be a finite number > 0, e.g. 1")
        if self.moe_every < 1:
            raise ConfigError(Override("moe_every", self.moe_every), ": must be >= 1, e.g. ", Override("moe_every", 1))
        if self.first_dense_layers >= self.num_layers:
            raise ConfigError(
                Override("first_dense_layers", self.first_dense_layers),
                f": leaves no mixture-of-experts layer of num_layers={self.num_layers}; e.g. ",
                Override("first_dense_layers", 0),
            )
        if (self.num_layers - self.first_dense_layers) % self.moe_every:
            raise ConfigError(
                Override("moe_every", self.moe_every),
                f": does not divide the {self.num_layers - self.first_dense_layers} layers after "
                f"first_dense_layers={self.first_dense_layers}; e.g. ",
                Override("moe_every", 1),
            )

    @property
    def is_moe(self) -> bool:
        """Whether some layers are mixtures of experts (``num_experts > 0``)."""
        return self.num_experts > 0

    @property
    def expert_dim(self) -> int:
        """The SwiGLU hidden width of one expert (``moe_mlp_dim``, or ``mlp_dim`` when 0)."""
        return self.moe_mlp_dim or self.mlp_dim

    def layer_kinds(self) -> tuple[bool, ...]:
        """Per layer, in order: True for a mixture-of-experts layer, False for a dense one.

        The first ``first_dense_layers`` are dense; after them every ``moe_every``-th layer (the last of
        each run of ``moe_every``) is a mixture of experts. A dense model: all False.
        """
        if not self.is_moe:
            return (False,) * self.num_layers
        return moe_placement(self.num_layers, self.first_dense_layers, self.moe_every)

    def layer_stacks(self) -> tuple[tuple[str, bool, int], ...]:
        """The stacks of blocks, ``(name, moe, layers)`` in creation order: a dense model has one, ``layers``;
        a mixture of experts has ``layers`` (its mixture-of-experts blocks) and, when some layers are dense,
        ``dense_layers`` before it."""
        if not self.is_moe:
            return (("layers", False, self.num_layers),)
        moe = self.num_moe_layers
        dense = self.num_layers - moe
        return ((("dense_layers", False, dense),) if dense else ()) + (("layers", True, moe),)

    @property
    def num_moe_layers(self) -> int:
        """Mixture-of-experts layers (0 for a dense model)."""
        return sum(self.layer_kinds())

    def architecture(self) -> dict[str, Any]:
        """The fields that fix the parameters (compared when restoring)."""
        return {name: getattr(self, name) for name in self.ARCHITECTURE_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> ModelConfig:
        return dataclasses.replace(self, **changes)

    def describe(self):
        """The model as the cost model sees it (`models.spec.describe`, a
        `sharding.modeldesc.ModelDescription`): parameters, products, work and
        activations per token, from the tables that build the modules."""
        # slow: models.spec imports JAX (through models.lora), this module does not; and it imports this module
        from models.spec import describe

        return describe(self)

    @property
    def num_params(self) -> int:
        """Parameter count (the formula in the module docstring), from `describe`."""
        return self.describe().num_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token, forward plus backward: the PaLM count (Chowdhery et al., 2022,
        Appendix B), ``6 * (P - V*D) + 12 * L * N * H * T``; one implementation,
        `sharding.modeldesc.ModelDescription.flops_per_token`.

        Args:
          seq_len: T, tokens per sequence.

        Returns:
          FLOPs per token (float).
        """
        return self.describe().flops_per_token(seq_len)


def moe_placement(num_layers: int, first_dense_layers: int, moe_every: int) -> tuple[bool, ...]:
    """Per layer, True for a mixture of experts: after ``first_dense_layers`` dense layers, the last of each
    run of ``moe_every`` layers (`ModelConfig.layer_kinds`)."""
    k, p = first_dense_layers, moe_every
    return tuple(i >= k and (i - k + 1) % p == 0 for i in range(num_layers))


PRESETS: dict[str, ModelConfig] = {
    # ~0.9M parameters: tests and the quick start.
    "test": ModelConfig(
        vocab_size=512, num_layers=4, embed_dim=128, mlp_dim=384, num_heads=4, num_kv_heads=2, head_dim=32
    ),
    # ~6M parameters: the default for `make train`.
    "small": ModelConfig(
        vocab_size=512, num_layers=6, embed_dim=256, mlp_dim=768, num_heads=8, num_kv_heads=4, head_dim=32
    ),
    # GPT-3 Small width and depth (Brown et al., 2020, Table 2.1) with SwiGLU.
    "125m": ModelConfig(
        vocab_size=32000, num_layers=12, embed_dim=768, mlp_dim=2048, num_heads=12, num_kv_heads=12, head_dim=64
    ),
    # Llama-3.2-1B shape (Meta, 2024) with a 32k vocabulary.
    "1b": ModelConfig(
        vocab_size=32000, num_layers=16, embed_dim=2048, mlp_dim=8192, num_heads=32, num_kv_heads=8, head_dim=64
    ),
    # Llama-2-7B shape (Touvron et al., 2023, Table 1; 6.74e9 parameters).
    "7b": ModelConfig(
        vocab_size=32000, num_layers=32, embed_dim=4096, mlp_dim=11008, num_heads=32, num_kv_heads=32, head_dim=128
    ),
    # A tiny mixture of experts for tests: the `test` shape with 8 experts, top-2, one shared expert,
    # the first layer dense.
    "moe-test": ModelConfig(
        vocab_size=512,
        num_layers=3,
        embed_dim=64,
        mlp_dim=128,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_experts=8,
        experts_per_token=2,
        moe_mlp_dim=32,
        shared_experts=1,
        first_dense_layers=1,
    ),
    # Mixtral-8x7B shape (Jiang et al., "Mixtral of Experts", 2024, Table 1; 46.7e9 parameters, 12.9e9
    # active): 8 experts, top-2, renormalised softmax weights.
    "mixtral-8x7b": ModelConfig(
        vocab_size=32000,
        num_layers=32,
        embed_dim=4096,
        mlp_dim=14336,
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        rope_theta=1e6,
        max_positions=32768,
        num_experts=8,
        experts_per_token=2,
    ),
    # Qwen3-30B-A3B shape (Qwen team, Qwen3 technical report, 2025; its config.json): 128 experts of width
    # 768, top-8, norm_topk_prob true, query/key norms, 30.5e9 parameters, 3.3e9 active (for dry runs and
    # the cost model).
    "qwen3-30b-a3b": ModelConfig(
        vocab_size=151936,
        num_layers=48,
        embed_dim=2048,
        mlp_dim=6144,
        num_heads=32,
        num_kv_heads=4,
        head_dim=128,
        rope_theta=1e6,
        max_positions=40960,
        norm_eps=1e-6,
        num_experts=128,
        experts_per_token=8,
        moe_mlp_dim=768,
        router_aux_coef=0.001,
        qk_norm=True,
    ),
}


def _coerce(field: dataclasses.Field, raw: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ConfigError(Override(field.name, raw), ": expected true or false")
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ConfigError(Override(field.name, raw), ": expected an integer") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(Override(field.name, raw), ": expected a number") from None
    return raw.strip()


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parses ``--set FIELD=VALUE`` strings into typed field values.

    Raises:
      ValueError: an item without ``=``, an unknown field (the message lists
        the fields), or a value of the wrong type.
    """
    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    changes: dict[str, Any] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        name = name.strip()
        if not sep:
            raise ConfigError(Field("override", repr(item)), ": expected FIELD=VALUE, e.g. ", Override("num_layers", 8))
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)  # a typo (num_layer) gets the field it missed
            hint = ("e.g. ", Override(close[0], raw.strip()), " ") if close else ()
            raise ConfigError(
                Field("override", repr(item)), f": unknown field {name!r}; ", *hint, f"(fields are {', '.join(fields)})"
            )
        changes[name] = _coerce(fields[name], raw)
    return changes


def get_config(preset: str, overrides: Iterable[str] = (), **changes) -> ModelConfig:
    """A preset with ``--set`` overrides and keyword changes applied.

    Raises:
      ValueError: unknown preset (lists them) or an invalid override.
    """
    if preset not in PRESETS:
        raise ConfigError(Field("preset", repr(preset)), f": unknown preset; choose one of {', '.join(PRESETS)}")
    merged = {**changes, **parse_overrides(overrides)}
    return PRESETS[preset].replace(**merged)


def config_differences(saved: dict[str, Any], current: ModelConfig) -> dict[str, tuple[Any, Any]]:
    """Architecture fields whose values differ: field -> (saved, current)."""
    now = current.architecture()
    defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig)}
    # A field newer than the saved metadata has its default in that checkpoint.
    return {
        name: (saved.get(name, defaults[name]), value)
        for name, value in now.items()
        if saved.get(name, defaults[name]) != value
    }
