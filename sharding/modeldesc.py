"""What a model tells the cost model about itself: the type of a model's self-description.

A model (``models.spec.describe``) produces one `ModelDescription`; `sharding.costmodel` and
`sharding.planner` read only it, so they hold no parameter names and no op counts of their own.
Everything is expressed in logical axes (`sharding.axes`): the rules (`sharding.rules`) say how each
axis splits over the mesh, and every per-token term names the logical axis whose split divides it.

The description holds:

* `Param`: every parameter array (path, shape, logical axes, stacked per layer or not, role, init).
* `Product`: the matrix products (a weight and which of its dimensions the input contracts),
  per layer and the output projection (the logits).
* `AttentionGeometry`: the score products' heads, key/value heads and head width.
* `AttentionTraits`: what each attention kernel the model can run costs (whether it holds the score
  matrix, how much of it it computes, its backward's work, whether it splits the length or runs
  under its own ``shard_map``), one per kernel, named as ``ModelConfig.attention`` names them; the
  cost model and the planner ask these, never a kernel's name.
* `Term`: per-token work and memory: elementwise FLOPs of a layer and of the loss, and the
  activations a layer saves for the backward pass, each with the logical axis that splits it,
  whether it grows with the keys a query sees (score-matrix terms), and which remat policies keep it.

This module imports nothing of the project but `sharding.axes`, `sharding.dispatch` and `sharding.exchange`, and
no JAX.
"""

from __future__ import annotations

import dataclasses
import functools
import math

from sharding import axes as ax
from sharding.dispatch import ExpertDispatch, expert_dispatch
from sharding.exchange import ContextExchange, context_exchange

__all__ = [
    "ROLES",
    "AttentionGeometry",
    "AttentionTraits",
    "ExpertGeometry",
    "ModelDescription",
    "Param",
    "Product",
    "Term",
    "held_copies",
]

ROLES = ("weight", "scale", "bias", "embedding", "output", "adapter")
"""Parameter roles: ``weight`` (of a matrix product inside the layers), ``scale`` (a norm's), ``bias`` (added
to a product's output), ``embedding`` (a lookup table ``[rows, width]``), ``output`` (the output
projection's weight), ``adapter`` (a low-rank adapter's factor, `models.lora`: where a model has them,
only they are trained and the rest is frozen)."""

KEPT = ("input", "dot", "none")
"""Which remat policies keep an activation term: ``input`` (the layer's input: kept by every policy,
and the only thing a pipeline stage keeps per microbatch), ``dot`` (a matrix product's output: kept
by ``dots``); a term with neither is kept only without remat. ``none`` marks, in
`ModelDescription.residuals` only, what ``--remat none`` keeps (there a ``dot`` term need not be one of
them: the attention's output projection is kept by ``dots`` alone)."""


@dataclasses.dataclass(frozen=True)
class Param:
    """One parameter array.

    Attributes:
      path: Where it lives in the parameter tree, ``/``-separated, e.g. ``layers/mlp/gate``.
      shape: Its shape; for a per-layer parameter one layer's slice (without ``layers``).
      axes: One logical axis name per dimension of ``shape``.
      per_layer: Whether it is stacked over the layers (a leading ``[layers]`` dimension).
      role: One of `ROLES`.
      init: ``normal`` (truncated normal, standard deviation ``fan_in ** -0.5``), ``ones`` or ``zeros``.
      fan_in: For ``normal``: the fan-in; None takes the first dimension.
      stack: For a per-layer parameter, the layers of its stack when that is not all of them (a
        mixture of experts' layers and its dense layers are two stacks); None: every layer.

    Raises:
      ValueError: When ``axes`` does not have one name per dimension, or on an unknown role or init.
    """

    path: str
    shape: tuple[int, ...]
    axes: tuple[str, ...]
    per_layer: bool = False
    role: str = "weight"
    init: str = "normal"
    fan_in: int | None = None
    stack: int | None = None

    def __post_init__(self):
        if len(self.axes) != len(self.shape):
            raise ValueError(f"parameter {self.path}: logical axes {self.axes} do not match shape {self.shape}")
        if self.role not in ROLES:
            raise ValueError(f"parameter {self.path}: role {self.role!r}; choose one of {', '.join(ROLES)}")
        if self.init not in ("normal", "ones", "zeros"):
            raise ValueError(f"parameter {self.path}: init {self.init!r}; choose normal, ones or zeros")

    @property
    def name(self) -> str:
        """The last component of the path (the attribute of its module)."""
        return self.path.rsplit("/", 1)[-1]

    @property
    def size(self) -> int:
        """Elements (of one layer's slice for per-layer parameters)."""
        return math.prod(self.shape)

    @property
    def matmul(self) -> bool:
        """Whether it is the weight of a matrix product."""
        return self.role in ("weight", "output")

    def under(self, prefix: str, per_layer: bool | None = None, stack: int | None = None) -> Param:
        """The same parameter at ``prefix/path`` (and stacked over layers when ``per_layer``, ``stack`` of
        them when not all)."""
        changes = {"path": f"{prefix}/{self.path}"}
        if per_layer is not None:
            changes["per_layer"] = per_layer
        if stack is not None:
            changes["stack"] = stack
        return dataclasses.replace(self, **changes)

    def copies(self, num_layers: int) -> int:
        """How many arrays of ``shape`` the model holds among ``num_layers`` of its layers: 1 for a parameter
        outside the layers; for a stack over every layer ``num_layers``; for a stack over some of them (a
        mixture of experts' layers, its dense layers) its ``stack`` layers, at most ``num_layers`` (0 for
        the head of a pipeline, which runs no layer; a stage's own layers where every layer is a mixture,
        as pipelines require)."""
        if not self.per_layer:
            return 1
        return num_layers if self.stack is None else min(self.stack, num_layers)


@dataclasses.dataclass(frozen=True)
class Product:
    """A matrix product of an activation with a weight.

    Attributes:
      weight: The weight's `Param`.
      contract: Indices of the weight's dimensions the input contracts (the others are the output's).
      recomputed: False for a product whose output no gradient needs, so that full remat does not
        redo it in the backward pass (XLA drops it as dead code): the last product of a block.
      share: The fraction of the weight one token of one layer multiplies, on average over the layers:
        1 for a dense product; for a mixture of experts' stacked expert weights ``[expert, ...]``,
        ``k / E`` (a token meets k of the E experts) times the fraction of layers that are mixtures.
      groups: 1 for a plain product. For a grouped product (`jax.lax.ragged_dot`, each row multiplied by
        one of the weight's ``groups`` slices along its ``expert`` dimension), the slices: a backend that
        lowers it densely multiplies every row by all of them, ``groups`` times the FLOPs ``share`` counts
        (`sharding.costmodel.experts.DENSE_GROUPED_BACKENDS`).
    """

    weight: Param
    contract: tuple[int, ...]
    recomputed: bool = True
    share: float = 1.0
    groups: int = 1

    @property
    def in_axes(self) -> tuple[str, ...]:
        return tuple(self.weight.axes[i] for i in self.contract)

    @property
    def out_axes(self) -> tuple[str, ...]:
        return tuple(a for i, a in enumerate(self.weight.axes) if i not in self.contract)

    @property
    def in_size(self) -> int:
        """Elements per token of the input."""
        return math.prod(self.weight.shape[i] for i in self.contract)

    @property
    def out_size(self) -> int:
        """Elements per token of the output."""
        return math.prod(s for i, s in enumerate(self.weight.shape) if i not in self.contract)


@dataclasses.dataclass(frozen=True)
class ExpertGeometry:
    """A mixture of experts' routing, for the dispatch collectives (`models.moe`).

    Attributes:
      layers: Mixture-of-experts layers.
      num_experts: E, routed experts per layer (logical axis ``expert``).
      experts_per_token: k.
      capacity_factor: 0 for dropless routing; else each expert takes at most
        ``ceil(capacity_factor * tokens * k / E)`` of one device's routed copies.
      embed_dim: D of the routed weights ``[E, D, F]`` (0: unknown, the rules' axes taken as dividing it).
      expert_dim: F, one routed expert's hidden width (0: unknown, likewise).

    Where the layer sits on a mesh, and so its dispatch, is `sharding.expert_placement.expert_placement`'s.
    """

    layers: int
    num_experts: int
    experts_per_token: int
    capacity_factor: float = 0.0
    embed_dim: int = 0
    expert_dim: int = 0

    def pipelined(self, num_layers: int) -> bool:
        """Whether pipeline stages may run the mixture of a model of ``num_layers`` layers: every layer one
        (stages run one stack of like blocks) and dropless (a capacity counts one device's rows, which the
        stages split differently), the rule ``train.setup.checks.check_experts`` enforces on a run."""
        return self.layers == num_layers and not self.capacity_factor

    def dispatch(self, expert_split: int, *, splits_tokens: bool = True) -> ExpertDispatch:
        """The dispatch over ``expert_split`` devices, ``splits_tokens`` saying whether the axes that split the
        experts split the tokens too (`sharding.dispatch.expert_dispatch`); a layout's placement
        (`sharding.expert_placement.expert_placement`) says both."""
        return expert_dispatch(self.capacity_factor, self.experts_per_token, expert_split, splits_tokens=splits_tokens)


def held_copies(tokens: int, experts_per_token: int, local_experts: int) -> int:
    """``M = tokens * min(K, E_local)``: the most routed copies of ``tokens`` tokens that ``E_local`` experts
    can receive (a token's ``K`` choices are distinct experts): the rows `models.moe.expert_outputs` computes."""
    return tokens * min(experts_per_token, local_experts)


@dataclasses.dataclass(frozen=True)
class AttentionGeometry:
    """The score and value products of one layer's attention (per token).

    Attributes:
      num_heads: N, query heads (logical axis ``heads_axis``).
      num_kv_heads: K, key/value heads (logical axis ``kv_axis``).
      head_dim: H, width of a head.
      heads_axis: Logical axis of the query heads.
      kv_axis: Logical axis of the key/value heads.
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    heads_axis: str = ax.HEADS
    kv_axis: str = ax.KV_HEADS

    def forward_flops(self, keys: float) -> float:
        """FLOPs per query of the two products (scores ``q.k`` and ``weights.v``), ``4 N H keys``."""
        return 4.0 * self.num_heads * self.head_dim * keys


@dataclasses.dataclass(frozen=True)
class AttentionTraits:
    """What one attention kernel costs, as the cost model and the planner read it.

    The score products themselves are `AttentionGeometry`'s; these say how a kernel computes them.
    FlashAttention (Dao et al., 2022; FlashAttention-2, Dao 2023) never holds the ``[T, S]`` scores,
    skips the tiles the causal mask empties (about half of them) and recomputes the scores in the
    backward pass (Dao 2023, Algorithm 2: five products against the forward's two).

    Attributes:
      name: The kernel's name (``ModelConfig.attention``), for messages and reports.
      materialises_scores: Whether it holds the ``[T, S]`` score matrix (einsum attention, XLA's
        ``dot_product_attention``): the description's ``per_key`` terms (the float32 softmax, the mask,
        their elementwise work) count the keys a query sees; False: they count none.
      saves_scores: Whether autodiff saves every layer's float32 probabilities and mask for the backward
        (XLA's ``dot_product_attention``); False for a kernel whose backward recomputes them (the reference
        attention saves the rows' log-sum-exp instead) or that never holds them.
      backward_scores: How many score-sized float32 arrays (each counted with its boolean mask) one
        layer's backward holds at once where the kernel materialises the scores: 2 for the reference
        attention's backward (the probabilities and dp, whose buffer ds takes), 4 for autodiff through
        einsum attention (the probabilities and three more). Read from XLA's buffer assignment of the 7B
        pipeline step (`bench/RESULTS.md`, "The reference attention's backward").
      key_fraction: Fraction of the ``T x S`` score products it computes: 1.0 for every entry, 0.5 when
        the tiles the causal mask empties are skipped.
      training_factor: FLOPs of the score products forward and backward, as a multiple of the forward's:
        3.0 (the backward does two products per forward one), 3.5 (FlashAttention-2's fused backward,
        which recomputes the scores: seven products for the forward's two), 4.5 (separate dq and dk/dv
        kernels, each recomputing the scores: nine).
      splits_length: Whether it runs with the length split over the ``context`` and ``sequence`` mesh axes
        (context parallelism: ring, all-to-all or USP attention); False: it needs the length whole on each
        device. Such a kernel's traffic is priced by its ``context_exchange``.
      under_shard_map: Whether it runs per device under its own ``shard_map`` (a Pallas kernel or a
        collective schedule, which GSPMD cannot partition); False: GSPMD partitions it like any op.
      searched: Whether the planner tries it when given no attentions (False for one priced exactly
        as another that it already tries).
      context_exchange: The name of the `sharding.exchange.ContextExchange` by which it moves keys and
        values when the length is split (`sharding.costmodel.context.context_traffic` prices it): ``ring``
        (blocks passed around the length's devices), ``all_to_all`` (length split traded for a head split),
        ``usp`` (all-to-all over the innermost length axis, ring over the others); empty for a kernel that
        does not split the length. `exchange` is the record.

    Raises:
      ValueError: On a key fraction outside (0, 1], a training factor below 1, score counts that do not
        fit ``materialises_scores`` (held or saved without it; fewer than one held with it, two if saved),
        or an unknown ``context_exchange``.
    """

    name: str
    materialises_scores: bool
    saves_scores: bool = False
    backward_scores: int = 0
    key_fraction: float = 1.0
    training_factor: float = 3.0
    splits_length: bool = False
    under_shard_map: bool = False
    searched: bool = True
    context_exchange: str = ""

    def __post_init__(self):
        if not 0 < self.key_fraction <= 1:
            raise ValueError(f"attention {self.name}: key_fraction {self.key_fraction} must be in (0, 1]")
        if self.training_factor < 1:
            raise ValueError(f"attention {self.name}: training_factor {self.training_factor} must be >= 1")
        held = self.backward_scores >= 1 + self.saves_scores if self.materialises_scores else not self.backward_scores
        if not held or (self.saves_scores and not self.materialises_scores):
            raise ValueError(
                f"attention {self.name}: backward_scores {self.backward_scores} and saves_scores {self.saves_scores} "
                f"with materialises_scores {self.materialises_scores}: a kernel that materialises the scores holds at "
                "least one in its backward (two where it also saved them), one that does not holds and saves none"
            )
        context_exchange(self.context_exchange)  # raises on an unknown name

    @property
    def exchange(self) -> ContextExchange:
        """Its context exchange's record (`sharding.exchange.NONE` for a kernel that keeps the length whole)."""
        return context_exchange(self.context_exchange)


@dataclasses.dataclass(frozen=True)
class Term:
    """A per-token amount: elementwise FLOPs, or the elements of an activation.

    Attributes:
      amount: Per token (per token and key when ``per_key``), before any split.
      axis: The logical axis whose split divides it (None: not split).
      per_key: Whether it is per entry of the ``[T, S]`` score matrix, i.e. times the keys a query
        sees; such terms exist only where the attention materialises the scores.
      bytes: For activations: bytes per element; None: the compute dtype's.
      kept: For activations: the `KEPT` tags of the remat policies that keep it.
      per_copy: For activations: an amount per routed copy of a mixture of experts that the device computes
        (`sharding.expert_placement.ExpertPlacement.copies_held` per token), not per token.
      what: What it is (for reports).
    """

    amount: float
    axis: str | None = None
    per_key: bool = False
    bytes: int | None = None
    kept: tuple[str, ...] = ()
    per_copy: bool = False
    what: str = ""


@dataclasses.dataclass(frozen=True)
class ModelDescription:
    """A decoder LM as the cost model sees it: a stack of ``num_layers`` identical layers between an
    embedding lookup and an output projection with a loss.

    Attributes:
      params: Every parameter (`Param`), in the order the model creates them.
      num_layers: L, layers in the stack.
      hidden: Elements per token of the activation between layers (D).
      products: The matrix products of one layer (`Product`).
      logits: The output projection (its weight is the ``output`` parameter, or the ``embedding``
        table when tied).
      attention: The score products (`AttentionGeometry`).
      attention_kernels: What each attention kernel the model can run costs (`AttentionTraits`),
        whichever ``ModelConfig.attention`` names: a layout names the one it prices.
      layer_elementwise: Elementwise FLOPs per token of one layer's forward pass (as XLA counts
        them: one per element per arithmetic op).
      loss_elementwise: Elementwise FLOPs per token of the loss's forward pass.
      activations: Activations one layer saves per token for the backward pass without remat.
      residuals: The residuals ``jax.vjp`` of one dense layer saves per token, each one as its jaxpr holds it
        (a pipeline stage keeps them from its forward tick, `sharding.pipeline.split.LayerSplit`; the
        whole-step program's fusions drop some of them, which `activations` leaves out); tagged ``input``,
        ``dot`` and ``none`` (`KEPT`). Empty: as `activations`.
      experts: The mixture of experts' routing (None: a dense model).
      inactive_params: Parameters a token does not use (a mixture of experts' routed experts it is not
        sent to: ``(E - k) / E`` of them); 0 for a dense model.
      frozen_bytes: Bytes per element of the parameters held but not trained where the model has adapters
        (role ``adapter``: the frozen base, `models.lora`): 4 (float32) or 2 (bfloat16).

    Raises:
      ValueError: When two parameters give one logical axis other than ``mlp`` different sizes.
    """

    params: tuple[Param, ...]
    num_layers: int
    hidden: int
    products: tuple[Product, ...]
    logits: Product
    attention: AttentionGeometry
    layer_elementwise: tuple[Term, ...] = ()
    loss_elementwise: tuple[Term, ...] = ()
    activations: tuple[Term, ...] = ()
    residuals: tuple[Term, ...] = ()
    attention_kernels: tuple[AttentionTraits, ...] = ()
    inactive_params: int = 0
    experts: ExpertGeometry | None = None
    frozen_bytes: int = 4

    def __post_init__(self):
        self.axis_sizes  # noqa: B018 (validates)

    def __hash__(self) -> int:  # hashed on every cached cost-model call: compute once
        return _hash(self)

    @functools.cached_property
    def axis_sizes(self) -> dict[str, int]:
        """Logical axis -> its size, read from the parameters (``layers``: L).

        ``mlp`` may have several sizes (a mixture of experts' dense, routed and shared widths): it gets their
        greatest common divisor, so a mesh axis counts as splitting it only where it splits every one.
        """
        sizes = {ax.LAYERS: self.num_layers}
        for p in self.params:
            for name, size in zip(p.axes, p.shape):
                if name is None:  # an unnamed dimension (the router's experts): never split
                    continue
                if name == ax.MLP:
                    sizes[name] = math.gcd(sizes.get(name, 0), size)
                elif sizes.setdefault(name, size) != size:
                    raise ValueError(f"logical axis {name!r} has sizes {sizes[name]} and {size} ({p.path})")
        return sizes

    def param(self, path: str) -> Param:
        """The parameter at ``path``.

        Raises:
          KeyError: When there is none.
        """
        for p in self.params:
            if p.path == path:
                return p
        raise KeyError(path)

    def attention_kernel(self, name: str) -> AttentionTraits:
        """The traits of the attention kernel called ``name``.

        Raises:
          ValueError: When the model has none of that name, naming it and those it has.
        """
        for kernel in self.attention_kernels:
            if kernel.name == name:
                return kernel
        known = ", ".join(k.name for k in self.attention_kernels) or "none"
        raise ValueError(f"attention {name!r} is not an attention of this model; it has {known}")

    def with_role(self, role: str) -> Param | None:
        """The first parameter with ``role`` (None when there is none)."""
        return next((p for p in self.params if p.role == role), None)

    @property
    def num_params(self) -> int:
        """Parameters in all (stacked ones times L)."""
        return sum(p.size * p.copies(self.num_layers) for p in self.params)

    @property
    def num_active_params(self) -> int:
        """Parameters one token uses (all of them for a dense model; a mixture of experts' active ones)."""
        return self.num_params - self.inactive_params

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token for MFU: ``6 * (P - V*D) + 12 * L * N * H * T``, ``P`` the active
        parameters (`num_active_params`).

        The count of Chowdhery et al., PaLM (2022), Appendix B: 6 FLOPs per parameter per token
        (2 forward, 4 backward), the embedding lookup excluded (but the output projection kept when
        it is the embedding table, tied), plus the attention score and value products over the whole
        ``T x T`` matrix (not halved for the causal mask, as in that count). Recompute is not
        counted (model FLOPs, not hardware FLOPs).

        Args:
          seq_len: T, tokens per sequence.

        Returns:
          FLOPs per token (float).
        """
        dense = sum(p.size * p.copies(self.num_layers) for p in self.params if p.role != "embedding")
        dense -= self.inactive_params
        if self.logits.weight.role == "embedding":
            dense += self.logits.weight.size
        attention = 3 * self.num_layers * self.attention.forward_flops(seq_len)
        return 6.0 * dense + attention


def _hash(desc: ModelDescription) -> int:
    cached = desc.__dict__.get("_hash")
    if cached is None:
        cached = hash(tuple(getattr(desc, f.name) for f in dataclasses.fields(desc)))
        object.__setattr__(desc, "_hash", cached)
    return cached
