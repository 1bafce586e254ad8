"""FLOPs of one device for one step (`Flops`).

The matrix products of the forward pass, ``2 * m * n * k`` per product, and of the backward pass
(twice the forward: the input and the weight gradient), as in Chowdhery et al., PaLM (2022),
Appendix B (``6 N`` per token plus ``12 L N H T`` for attention) and Narayanan et al., "Efficient
large-scale language model training on GPU clusters using Megatron-LM" (SC'21), section 5.1 (``+2 N``
per token with full recomputation). The attention products are counted over the whole ``T x S`` score
matrix for the reference (einsum + mask) implementation, and over half of it for FlashAttention, which
skips masked tiles (Dao, FlashAttention-2, 2023, section 3.1), whose backward recomputes the scores (5
products instead of 4). Besides the products: the elementwise work as XLA counts it (1 FLOP per element
per arithmetic op; the description's terms, times `ELEMENTWISE_BACKWARD_FACTOR` for the backward pass)
and the optimizer update (`OPTIMIZER_FLOPS_PER_PARAM`).

Uneven sequence shards (``Layout.context_shares``, ring attention in the zigzag layout) pad every device's
block to the largest share: the weight products, the head and the elementwise work run on every position
of the padded block and do not shrink on a device with fewer real tokens; only attention, whose kernels skip
tiles of padding, does: device r computes ``tokens[r] / 2 x (T + 1)`` query-key pairs a sequence.

Checked on CPU (``tests/test_costmodel.py``): `Cost.counted_flops` against
``compiled.cost_analysis()["flops"]``, which counts the body of each ``while`` loop once, and
`Cost.matmul_flops` against the compiled HLO's products with loop trip counts folded in
(`sharding.hlo.dot_flops`).

Units: FLOPs.
"""

from __future__ import annotations

import dataclasses
import math

from sharding import axes as ax
from sharding.costmodel.context import context_groups
from sharding.costmodel.experts import DENSE_GROUPED_BACKENDS, batched_experts
from sharding.costmodel.layout import (
    Layout,
    _axis_split,
    _copies_held,
    _per_token,
    _Placed,
    _Shape,
    attention_of,
    expert_placement_of,
)
from sharding.costmodel.memory import _held_params
from sharding.costmodel.stream import backward_split, gradient_shares, head_backward_split
from sharding.modeldesc import AttentionTraits, ModelDescription, Product
from sharding.parallel import CONTIGUOUS
from sharding.rules import Rules

#: XLA-counted FLOPs per parameter of the update (HloCostAnalysis: 1 FLOP per element per
#: arithmetic op; square roots are counted as transcendentals, not FLOPs). The step divides the
#: gradient by the token count (1), takes the gradient norm for the metrics and for clipping
#: (2 + 2: square, sum), clips (3: divide, multiply, select), updates AdamW's moments (3 + 4),
#: corrects their bias (2), forms the update (3: add eps twice, divide), adds decoupled weight decay
#: (2), scales by the learning rate (1), applies it (1) and keeps the old values when the step is
#: not finite (3 selects: parameter and two moments), about 30; compiling the step of a 1-layer
#: ``test`` model on ``data=8`` with 8, 16 and 32 tokens per device and subtracting the
#: per-token part gives 34.9 (bench/costmodel.py prints it). We use 35.
OPTIMIZER_FLOPS_PER_PARAM = 35.0

#: The backward pass does about twice the forward's elementwise work (the model's elementwise terms,
#: `sharding.modeldesc.ModelDescription.layer_elementwise`, are of the forward pass).
ELEMENTWISE_BACKWARD_FACTOR = 2.0


@dataclasses.dataclass(frozen=True)
class Flops:
    """FLOPs of one device per step, by part.

    Attributes:
      layers: Matrix products of the transformer blocks' weights (forward and backward).
      attention: Score and value products (forward and backward).
      logits: Output projection (forward and backward).
      recompute: Forward products redone in the backward pass under remat (and always with
        pipeline stages, whose backward pass recomputes each layer).
      elementwise: Norms, activations, softmax, rotary, loss (as XLA counts them).
      optimizer: The update of this device's parameter shard.
    """

    layers: float
    attention: float
    logits: float
    recompute: float
    elementwise: float
    optimizer: float

    @property
    def matmul(self) -> float:
        return self.layers + self.attention + self.logits + self.recompute

    @property
    def total(self) -> float:
        return self.matmul + self.elementwise + self.optimizer


def _per_token_flops(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    recomputes: float = 0,
    backend: str = "gpu",
) -> dict[str, float]:
    """FLOPs per token, forward and backward: of one layer (``layers``: weight products, ``attention``,
    ``recompute``, ``elem_layer``; ``counted_layer``: their sum as ``cost_analysis`` counts it) and of what
    runs once (``logits``, ``elem_loss``). ``recomputes``:
    extra forward passes of each layer in the backward pass beyond the remat policy's (the
    pipeline's backward pass recomputes every layer: 1, zero bubble's too: its weight-gradient pass runs
    the weight-gradient products alone, from what its input-gradient pass kept). ``backend``: a grouped product
    costs every group's product per row on `DENSE_GROUPED_BACKENDS`."""
    mesh = layout.mesh
    # Axes that may split a batch, not the rules' batch axes: a weight split over one is gathered before its
    # product (FSDP), so it does not split the work, even where the rules keep the batch whole over it (the
    # compiled step of ``--rule batch=data+fsdp`` on ``expert=4,fsdp=2`` gathers over ``expert``: 1.046 GFLOP
    # compiled, 1.038 priced; tests/test_moe_placement.py).
    compute_axes = tuple(a for a in mesh if a not in ax.BATCH_MESH_AXES)
    dense_groups = backend in DENSE_GROUPED_BACKENDS and not batched_experts(model, layout)
    groups_held = 1.0  # every row against every group: under the ring, min(k, E_local) / k of the k per token
    if dense_groups and model.experts is not None:
        # a device's rows meet its E / E_p experts: the split over compute axes already divides the weight's
        # size below, the split over batch axes (which do not divide the work) is divided here
        place = expert_placement_of(model, rules, mesh)
        batch_split = math.prod(place.sizes[a] for a in place.expert_axes if a not in compute_axes)
        groups_held = _copies_held(model, rules, mesh) / (model.experts.experts_per_token * batch_split)

    def forward(product: Product) -> float:
        groups = product.groups * groups_held if dense_groups and product.groups > 1 else 1
        return 2.0 * product.share * groups * product.weight.size / placed[product.weight.path].factor(*compute_axes)

    layer_fwd = sum(forward(p) for p in model.products)
    # backward: the input and the weight gradient, each as much as the forward, less where the residual stream
    # is split along embed (`sharding.costmodel.stream.gradient_shares`)
    stream = backward_split(layout, placed)
    layer_bwd = sum(forward(p) * sum(gradient_shares(p, stream)) for p in model.products)
    # Full remat recomputes the block's forward except the products whose output no gradient
    # needs (XLA drops them as dead code); "dots" saves the weight products and recomputes the
    # attention products (they have batch dimensions).
    kept_fwd = layer_fwd - sum(forward(p) for p in model.products if not p.recomputed)
    geometry = model.attention
    heads = _axis_split(model, geometry.heads_axis, rules, mesh)
    kernel = attention_of(model, layout)
    whole = kernel.materialises_scores
    keys = s.seq if s.keys is None else s.keys  # uneven context shares: the real length, not the padded one
    attn_fwd = geometry.forward_flops(keys * kernel.key_fraction) / heads  # flash: masked tiles skipped
    attn_fwd *= _busiest_ring_share(kernel, layout) * s.real  # uneven shares: padding skipped
    attn_total = attn_fwd * kernel.training_factor  # flash bwd: 5 products
    logits = model.logits
    logits_fwd = (
        2.0 * logits.in_size * logits.out_size / math.prod(_axis_split(model, a, rules, mesh) for a in logits.out_axes)
    )
    logits_bwd = logits_fwd * sum(gradient_shares(logits, head_backward_split(model, layout, placed), head=True))
    recompute = {"none": 0.0, "full": kept_fwd + attn_fwd, "dots": attn_fwd}[layout.remat]
    recompute += recomputes * (kept_fwd + attn_fwd)
    passes = 1.0 + ELEMENTWISE_BACKWARD_FACTOR + (1.0 if layout.remat != "none" else 0.0)
    elem_layer = passes * _per_token(model, "layer_elementwise", rules, mesh, s.seq if whole else 0.0)
    layer = layer_fwd + layer_bwd + attn_total + recompute + elem_layer
    if kernel.under_shard_map:
        # A Pallas kernel's products are invisible to cost_analysis: on CPU its interpreter's grid is a loop
        # whose body (one tile) is counted once; on GPU it is a custom call, counted as nothing.
        attn_recomputed = {"none": 0.0, "full": attn_fwd, "dots": attn_fwd}[layout.remat] + recomputes * attn_fwd
        layer -= attn_total + attn_recomputed
    return {
        "layers": layer_fwd + layer_bwd,
        "attention": attn_total,
        "recompute": recompute,
        "elem_layer": elem_layer,
        "counted_layer": layer,
        "logits": logits_fwd + logits_bwd,
        "elem_loss": (1.0 + ELEMENTWISE_BACKWARD_FACTOR) * _per_token(model, "loss_elementwise", rules, mesh, 0.0),
    }


def _busiest_ring_share(kernel: AttentionTraits, layout: Layout) -> float:
    """The causal attention work of a ring's busiest device over its devices' mean.

    Split over a ring of R devices in the zigzag layout (each device holds chunk r and 2R-1-r), every
    device computes the same causal work (Brandon et al., "Striped attention", 2023; the zigzag layout of
    Megatron's context parallelism): 1. In the contiguous layout the last device's queries see every
    block, R - 1/2 blocks against the mean R/2: (2R - 1)/R. The all-to-all part of a split gathers the
    whole length per head, so it adds no imbalance.
    """
    if layout.context_layout != CONTIGUOUS or kernel.key_fraction >= 1:
        return 1.0
    ring_axes, _ = context_groups(kernel, layout.mesh, layout.rules_table().mesh_axes(ax.LENGTH))
    ring = math.prod(layout.mesh[a] for a in ring_axes)
    return (2 * ring - 1) / ring


def _flops(
    model: ModelDescription,
    layout: Layout,
    rules: Rules,
    placed: dict[str, _Placed],
    s: _Shape,
    backend: str = "gpu",
) -> tuple[Flops, float]:
    """Per-step FLOPs and the loop-bodies-once count of ``cost_analysis`` (no pipeline) on ``backend``."""
    unit = _per_token_flops(model, layout, rules, placed, s, backend=backend)
    per_token_layer = unit["counted_layer"]
    per_token_outside = unit["logits"] + unit["elem_loss"]
    optimizer = OPTIMIZER_FLOPS_PER_PARAM * _held_params(model, layout, rules, placed, s)
    tokens = s.tok * s.micro
    flops = Flops(
        layers=tokens * s.layers * unit["layers"],
        attention=tokens * s.layers * unit["attention"],
        logits=tokens * unit["logits"],
        recompute=tokens * s.layers * unit["recompute"],
        elementwise=tokens * (s.layers * unit["elem_layer"] + unit["elem_loss"]),
        optimizer=optimizer,
    )
    counted = s.tok * (per_token_layer + per_token_outside) + optimizer
    return flops, counted
