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

(with tied embeddings the first term is V*D; with ``qkv_bias`` each layer adds N*H + 2*K*H).
`ModelConfig.num_params` computes exactly this (from `models.spec`, the tables that build the
modules); start-up checks it against the built model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from models import attention_registry

DTYPES = ("float32", "bfloat16")
REMAT_POLICIES = ("none", "full", "dots")
LOGITS_IMPLS = ("auto", "gathered", "vocab_parallel")  # sharding.vocab.OUTPUT_IMPLS
ROPE_TYPES = ("default", "llama3")


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
    dtype: str = "float32"
    remat: str = "none"
    attention: str = "reference"
    logits: str = "auto"

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
    )

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Raises ValueError naming the field (as ``--set FIELD=...``) that is invalid."""
        for name in ("vocab_size", "num_layers", "embed_dim", "mlp_dim", "num_heads", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--set {name}={getattr(self, name)}: must be a positive integer")
        for name, example in (("rope_theta", 10000.0), ("norm_eps", 1e-5)):  # -1 makes NaN rotations; NaN spreads
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise ValueError(f"--set {name}={value}: must be a finite number > 0, e.g. --set {name}={example:g}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (grouped-query "
                f"attention shares each KV head among num_heads / num_kv_heads query heads); --set num_heads or "
                f"--set num_kv_heads to values where it is, e.g. --set num_kv_heads={self.num_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"--set head_dim={self.head_dim}: rotary embeddings need an even head_dim")
        if self.rope_type == "llama3":
            if not 0 < self.rope_low_freq_factor < self.rope_high_freq_factor:
                raise ValueError(
                    f"--set rope_low_freq_factor={self.rope_low_freq_factor} with rope_high_freq_factor="
                    f"{self.rope_high_freq_factor}: need 0 < low < high, e.g. 1 and 4 (Llama 3.1)"
                )
            for name, example in (("rope_factor", 8), ("rope_original_max_positions", 8192)):
                if getattr(self, name) <= 0:
                    raise ValueError(
                        f"--set {name}={getattr(self, name)}: must be positive, e.g. {example} (Llama 3.1)"
                    )
        checks = (
            ("dtype", DTYPES),
            ("remat", REMAT_POLICIES),
            ("attention", attention_registry.names()),
            ("logits", LOGITS_IMPLS),
            ("rope_type", ROPE_TYPES),
        )
        for name, allowed in checks:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} {getattr(self, name)!r}: choose one of {', '.join(allowed)}")

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
        from models.spec import describe  # models.spec imports this module

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
}


def _coerce(field: dataclasses.Field, raw: str) -> Any:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    if kind == "bool":
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"--set {field.name}={raw}: expected true or false")
    if kind == "int":
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"--set {field.name}={raw}: expected an integer") from None
    if kind == "float":
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"--set {field.name}={raw}: expected a number") from None
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
            raise ValueError(f"--set {item!r}: expected FIELD=VALUE, e.g. --set num_layers=8")
        if name not in fields:
            raise ValueError(f"--set {item!r}: unknown field {name!r}; fields are {', '.join(fields)}")
        changes[name] = _coerce(fields[name], raw)
    return changes


def get_config(preset: str, overrides: Iterable[str] = (), **changes) -> ModelConfig:
    """A preset with ``--set`` overrides and keyword changes applied.

    Raises:
      ValueError: unknown preset (lists them) or an invalid override.
    """
    if preset not in PRESETS:
        raise ValueError(f"--model {preset!r}: unknown preset; choose one of {', '.join(PRESETS)}")
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
