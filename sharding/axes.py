"""The names meshwork uses for mesh axes and logical axes, in one place.

Mesh axes are the physical axes of a `jax.sharding.Mesh`. Their order in
`MESH_AXES` is the order of the mesh: the axis whose traffic tolerates the
slowest links comes first (outermost), `tensor`, which communicates inside
every matrix product, comes last (innermost, fastest links).

The length of a sequence may be split over two axes (context parallelism):
``sequence``, inside a host, and ``context`` outside it. Ring and all-to-all
attention treat the two as one split; USP attention runs all-to-all over
``sequence`` and a ring over ``context`` (Fang & Zhao, 2024).

Logical axes name the dimensions of parameters and activations in model code.
Model code uses only logical names; `sharding.rules` maps them onto mesh axes.
The experts dimension of a mixture-of-experts layer's weights has the logical name ``expert``, the
same as the mesh axis the rules map it to. The ``expert`` mesh axis also splits the batch: attention
and the dense layers run data-parallel over it, the experts expert-parallel (`models.moe`).

The experts' weights name their embedding dimension ``expert_embed``: the rules split it over ``fsdp``
only, since ``expert`` already splits their experts dimension, while every other weight's ``embed`` is
split over ``fsdp`` and ``expert`` (ZeRO-3 over all the devices of the batch; MaxText's ``embed`` and
``embed_no_exp``).

Activations use their own name where their rule must differ from the
weights' (``act_embed``: the embedding dimension of an activation stays whole
while the weights' ``embed`` is split over ``fsdp``). ``act_length`` is the length of the residual
stream between the attention and MLP blocks (the embedding output, the norms' inputs, the residual adds,
the loss's input), ``length`` the length inside those blocks: the two differ under sequence parallelism
(Korthikanti et al., 2022), where ``act_length`` is split over ``tensor`` as well.
"""

# Mesh axes, outermost (slowest links) to innermost (fastest links).
DATA = "data"
STAGE = "stage"
FSDP = "fsdp"
CONTEXT = "context"  # the outer context axis: the ring of USP attention (all-to-all runs over sequence)
SEQUENCE = "sequence"
TENSOR = "tensor"
EXPERT = "expert"  # mixture-of-experts: splits the experts, and the batch outside them

MESH_AXES: tuple[str, ...] = (DATA, STAGE, FSDP, EXPERT, CONTEXT, SEQUENCE, TENSOR)

# Axes that split the activations' length (context parallelism), outermost first.
LENGTH_MESH_AXES: tuple[str, ...] = (CONTEXT, SEQUENCE)
RESERVED_MESH_AXES: tuple[str, ...] = ()

# Axes that split the batch (data parallelism in the wide sense).
BATCH_MESH_AXES: tuple[str, ...] = (DATA, FSDP, EXPERT)

# Logical axes of parameters.
EMBED = "embed"
MLP = "mlp"
HEADS = "heads"
KV_HEADS = "kv_heads"
HEAD_DIM = "head_dim"
VOCAB = "vocab"
LAYERS = "layers"
# EXPERT (above): the experts dimension of mixture-of-experts weights.
EXPERT_EMBED = "expert_embed"  # the embed dimension of the experts' weights (MaxText's ``embed_no_exp``)
ROUTER_EXPERTS = "router_experts"  # the router's experts dimension: whole on every device (no rule maps it)
LORA_RANK = "lora_rank"  # a low-rank adapter's rank dimension (`models.lora`): whole on every device (no rule maps it)

# Logical axes of activations.
BATCH = "batch"
LENGTH = "length"
ACT_EMBED = "act_embed"
ACT_LENGTH = "act_length"  # the residual stream's length outside attention and MLP (sequence parallelism)

LOGICAL_AXES: tuple[str, ...] = (
    BATCH,
    LENGTH,
    EMBED,
    MLP,
    HEADS,
    KV_HEADS,
    HEAD_DIM,
    VOCAB,
    LAYERS,
    ACT_EMBED,
    EXPERT,
    EXPERT_EMBED,
    ROUTER_EXPERTS,
    ACT_LENGTH,
    LORA_RANK,
)
