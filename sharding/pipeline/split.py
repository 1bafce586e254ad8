"""A layer's backward pass cut into its input-gradient half and its weight-gradient half.

Zero bubble (Qi et al., "Zero Bubble Pipeline Parallelism", ICLR 2024, section 2) runs the backward of a
stage in two passes: B, the cotangent of the stage's input, which the previous stage waits for, and W, the
cotangents of the weights, which nothing waits for. For a product ``y = x w``, B computes ``dx = dy w^T`` and
W computes ``dw = x^T dy``: W needs the product's input ``x`` and the cotangent ``dy`` of its output, both of
which B has in hand. Keeping them from B to W makes W exactly the weight-gradient products (and the weights'
other cotangent terms: a norm's scale, ``sum(dy * x_hat)``), with no recomputation of the layer.

The layer functions are generic (``(params, h, *extras) -> h``), so the cut is made on the traced program,
not on the layer's code: `LayerSplit.trace` traces ``vjp(layer)(g)`` with respect to both the weights and the
input into one jaxpr (calls into `jax.jit` functions and `jax.checkpoint` regions inlined, so that each
product's transpose is its own equation), and splits its equations:

* B: every equation the input's cotangent needs, and every equation of the forward pass (those that depend
  on the activations, not on the output's cotangent) the weights' cotangents need;
* W: the rest of what the weights' cotangents need (what depends on the weights or constants alone is
  recomputed there rather than kept), less what is no weight-gradient product and reads none's result
  where B running it shrinks the cut: a norm scale's cotangent ``sum(dy * x_hat)`` is a reduction, so B
  computes it and keeps ``[embed]`` instead of two token-sized float32 operands (W is then the products alone);
* the cut: the values W reads that B computes (or that are the pass's inputs other than the weights). B
  returns them (``saved``); W takes them back and evaluates its equations with the weights at hand.

Equations are evaluated by binding their primitives, as `jax.core.eval_jaxpr` does, so B and W trace into
whatever program calls them (a `jax.lax.scan`, a `jax.lax.cond`, a `jax.shard_map`). W traces the same
function again with placeholders of the same types (tracing is deterministic) and checks that its cut has
the shapes and dtypes of what it was given.

Kept residuals (``--remat none`` and ``dots`` in a pipeline stage). The same traced program, with the layer's
output added, also splits the other way: into the forward equations whose results the backward reads (those
that depend on the layer's input and not on the output's cotangent, outside any differentiated
`jax.checkpoint` region) and the rest. The forward tick runs the former (`LayerSplit.forward_pass`) and keeps
the values the rest reads (`LayerSplit.kept_avals`, the layer's residuals, Korthikanti et al. 2022 section 4);
the backward tick runs the rest on them (`LayerSplit.backward_pass`, or B with ``kept``), recomputing nothing
of the forward but what a checkpoint policy chose not to save (the body of the checkpoint's backward, which
the rule leaves there: ``dots`` keeps the products' outputs and recomputes the elementwise work between
them) and what depends on the weights or side inputs alone (casts, rotary tables).

Bytes the cut holds per token of a dense transformer layer (one entry per distinct value): the inputs of the
products (the normalised input shared by q, k, v; the attention output; the normalised input shared by the
gate and up projections; the gated activation) and their output cotangents (q, k, v, attention projection,
gate, up, down); per layer, the two norm scales' cotangents.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.extend import core as jex_core

from sharding.parallel import to_varying, varying_axes

#: Call-like primitives whose body is inlined (by name, with the parameter holding the body): their
#: transposes compute the cotangents of all their operands in one equation, which the cut must see apart.
_INLINED = {
    "jit": "jaxpr",
    "pjit": "jaxpr",
    "closed_call": "call_jaxpr",
    "core_call": "call_jaxpr",
    "remat2": "jaxpr",
    "checkpoint": "jaxpr",
    "custom_jvp_call": "call_jaxpr",
    "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr",
}


class _Const:
    """A constant operand (a literal or a jaxpr constant)."""

    __slots__ = ("val",)

    def __init__(self, val):
        self.val = val


@dataclasses.dataclass(frozen=True)
class _Node:
    """One equation of the flattened program: operands and results are value ids (ints) or `_Const`."""

    primitive: Any
    params: dict
    inputs: tuple
    outputs: tuple[int, ...]
    ctx: Any
    recomputed: bool = False  # inside a differentiated checkpoint region (its forward is run again there)


def _is_literal(atom) -> bool:
    """Whether a jaxpr operand is a literal (a constant written into the equation), not a variable."""
    return isinstance(atom, jex_core.Literal)


#: Checkpoint primitives: equations inlined from their bodies are marked `_Node.recomputed` (a differentiated
#: checkpoint's region is its backward's recomputation), which the kept-residual split leaves in the backward.
_CHECKPOINTS = frozenset({"remat2", "checkpoint"})


def _flatten(jaxpr, consts, args, nodes: list, counter: list, avals: dict, recomputed: bool = False) -> list:
    """Appends the equations of ``jaxpr`` (an open jaxpr) to ``nodes`` with `_INLINED` calls inlined.

    Args:
      jaxpr: the jaxpr.
      consts: operands of its constvars (ids or `_Const`).
      args: operands of its invars.
      nodes: the flat program so far.
      counter: a one-element list, the next free value id.
      avals: value id -> abstract value, filled in for every result.
      recomputed: mark the equations `_Node.recomputed` (inside a checkpoint region).

    Returns:
      The operands of its outputs.
    """
    env: dict = {}
    for var, atom in zip(jaxpr.constvars, consts):
        env[var] = atom
    for var, atom in zip(jaxpr.invars, args):
        env[var] = atom

    def read(atom):
        if _is_literal(atom):
            return _Const(atom.val)
        return env[atom]

    for eqn in jaxpr.eqns:
        operands = [read(a) for a in eqn.invars]
        body = _INLINED.get(eqn.primitive.name)
        sub = eqn.params.get(body) if body else None
        if sub is not None:
            inner, inner_consts = (sub.jaxpr, [_Const(c) for c in sub.consts]) if hasattr(sub, "consts") else (sub, [])
            if len(inner.invars) == len(operands):
                inside = recomputed or eqn.primitive.name in _CHECKPOINTS
                outs = _flatten(inner, inner_consts, operands, nodes, counter, avals, inside)
                for var, atom in zip(eqn.outvars, outs):
                    env[var] = atom
                continue
        ids = []
        for var in eqn.outvars:
            ids.append(counter[0])
            env[var] = counter[0]
            avals[counter[0]] = var.aval
            counter[0] += 1
        nodes.append(
            _Node(eqn.primitive, eqn.params, tuple(operands), tuple(ids), getattr(eqn, "ctx", None), recomputed)
        )
    return [read(a) for a in jaxpr.outvars]


def _bind(node: _Node, values: list):
    """Evaluates one node on ``values`` in the current trace (as `jax.core.eval_jaxpr`)."""
    primitive = node.primitive
    if primitive.name == "pvary":  # an invariant->varying cast; the operand may already vary (read from a ring)
        axes = tuple(a for a in node.params["axes"] if a not in varying_axes(values[0]))
        if not axes:
            return values
        params = {**node.params, "axes": axes}
        return primitive.bind(*values, **params)
    bind_params = primitive.get_bind_params(node.params)
    if isinstance(bind_params, tuple):  # (subfuns, params) in some JAX versions
        subfuns, bind_params = bind_params
        values = [*subfuns, *values]
    manager = getattr(node.ctx, "manager", None)
    if manager is None:
        return primitive.bind(*values, **bind_params)
    with manager:
        return primitive.bind(*values, **bind_params)


@dataclasses.dataclass(frozen=True)
class LayerSplit:
    """The traced backward pass of one layer, its equations split into B and W (module docstring).

    Attributes:
      nodes: the flat program (`_Node`), in order.
      inputs: value ids of the traced function's inputs: the weights' leaves, ``h``, the cotangent ``g``, then
        the extras' leaves.
      n_params: how many of ``inputs`` are the weights' leaves.
      params_tree: the weights' tree structure.
      dx: operand of the input's cotangent.
      dw: operands of the weights' cotangents (in ``params_tree``'s leaf order).
      b_nodes, w_nodes: indices into ``nodes`` of the two passes.
      cut: value ids W reads that B (or a non-weight input) provides, in a fixed order: what B saves.
      cut_avals: their abstract values (shape, dtype).
      y: operand of the layer's output.
      kept: indices into ``nodes`` the forward tick runs where residuals are kept (module docstring): the
        equations of B or W that depend on ``h``, not on ``g``, and are no checkpoint region's.
      forward_nodes: what the forward tick runs then: ``kept`` and what they and the output need.
      kept_cut: value ids that ``kept`` make and the backward reads (or B hands to W), in a fixed order.
      kept_avals: their abstract values (shape, dtype): one slot's residuals.
    """

    nodes: tuple
    inputs: tuple[int, ...]
    n_params: int
    params_tree: Any
    dx: Any
    dw: tuple
    b_nodes: tuple[int, ...]
    w_nodes: tuple[int, ...]
    cut: tuple[int, ...]
    cut_avals: tuple
    y: Any = None
    kept: tuple[int, ...] = ()
    forward_nodes: tuple[int, ...] = ()
    kept_cut: tuple[int, ...] = ()
    kept_avals: tuple = ()

    @classmethod
    def trace(cls, layer, params, h, g, extras) -> LayerSplit:
        """Traces ``vjp(lambda w, h: layer(w, h, *extras), params, h)(g)`` and splits it.

        Args:
          layer: ``(params, h, *extras) -> h``.
          params: the layer's weights (a tree of arrays or tracers).
          h: ``[microbatch, ...]`` the layer's input.
          g: ``[microbatch, ...]`` the cotangent of its output.
          extras: the layer's side inputs (a tuple; not differentiated).
        """
        leaves, tree = jax.tree.flatten(params)
        extra_leaves, extra_tree = jax.tree.flatten(tuple(extras))

        def pure(leaves, h, g, extra_leaves):
            w = jax.tree.unflatten(tree, leaves)
            e = jax.tree.unflatten(extra_tree, extra_leaves)
            y, vjp = jax.vjp(lambda w, h: layer(w, h, *e), w, h)
            dw, dh = vjp(g)
            return jax.tree.leaves(dw), dh, y

        closed = jax.make_jaxpr(pure)(leaves, h, g, extra_leaves)
        jaxpr = closed.jaxpr
        n_in = len(jaxpr.invars)
        counter, nodes = [n_in], []
        avals = {i: var.aval for i, var in enumerate(jaxpr.invars)}
        outs = _flatten(jaxpr, [_Const(c) for c in closed.consts], list(range(n_in)), nodes, counter, avals)
        dw, dx, y = tuple(outs[: len(leaves)]), outs[len(leaves)], outs[len(leaves) + 1]
        producer = {i: k for k, node in enumerate(nodes) for i in node.outputs}
        g_id = len(leaves) + 1
        # values that depend on the output's cotangent, and values that depend on the activations (the input or
        # the extras): what depends on neither (the weights, constants) W recomputes rather than keeps
        tangent, act = {g_id}, set(range(len(leaves), n_in)) - {g_id}
        for node in nodes:
            for marked in (tangent, act):
                if any(isinstance(a, int) and a in marked for a in node.inputs):
                    marked.update(node.outputs)

        def needed(roots) -> set[int]:
            seen, stack = set(), [r for r in roots if isinstance(r, int) and r in producer]
            while stack:
                k = producer[stack.pop()]
                if k in seen:
                    continue
                seen.add(k)
                stack.extend(a for a in nodes[k].inputs if isinstance(a, int) and a in producer)
            return seen

        for_dx, for_dw = needed([dx]), needed(dw)
        b = for_dx | {
            k for k in for_dw if act.intersection(nodes[k].outputs) and not tangent.intersection(nodes[k].outputs)
        }
        w = for_dw - b
        weight_inputs = set(range(len(leaves)))
        cut = _cut(nodes, w, dw, weight_inputs)
        # B also runs the weight cotangents that are no product (a norm scale's ``sum(dy * x_hat)``): it keeps
        # their small results instead of their token-sized operands, where that shrinks the cut
        moved = _not_products(nodes, w, tangent | act, avals)
        if moved:
            b_more = b | moved | needed([i for k in moved for i in nodes[k].inputs])
            w_less = w - moved
            cut_less = _cut(nodes, w_less, dw, weight_inputs)
            if _bytes(cut_less, avals) < _bytes(cut, avals):
                b, w, cut = b_more, w_less, cut_less
        kept, forward_nodes, kept_cut = _kept(nodes, b | w, len(leaves), tangent, cut, [dx, *dw], y, needed)
        return cls(
            tuple(nodes),
            tuple(range(n_in)),
            len(leaves),
            tree,
            dx,
            dw,
            tuple(sorted(b)),
            tuple(sorted(w)),
            tuple(cut),
            tuple((tuple(avals[i].shape), avals[i].dtype) for i in cut),
            y,
            kept,
            forward_nodes,
            kept_cut,
            tuple((tuple(avals[i].shape), avals[i].dtype) for i in kept_cut),
        )

    @property
    def needs_params(self) -> bool:
        """Whether W reads the weights (else it runs on the saved values alone)."""
        weights = set(self.inputs[: self.n_params])
        return any(isinstance(a, int) and a in weights for k in self.w_nodes for a in self.nodes[k].inputs)

    @property
    def saved_bytes(self) -> int:
        """Bytes of one layer's cut (what B keeps for W)."""
        import numpy as np

        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.cut_avals)

    def _run(self, which, env: dict) -> None:
        for k in which:
            node = self.nodes[k]
            values = [a.val if isinstance(a, _Const) else env[a] for a in node.inputs]
            out = _bind(node, values)
            if node.primitive.multiple_results:
                env.update(zip(node.outputs, out))
            else:
                env[node.outputs[0]] = out

    def input_pass(self, params, h, g, extras, kept=None):
        """B: ``(dh, saved)``, the input's cotangent ``[microbatch, ...]`` and the tuple of cut values W needs
        (each cast varying over the manual axes ``h`` or ``g`` vary over, as `zeros` makes them, so that a
        conditional's branches and a ring of them take them alike). With ``kept`` (the residuals
        `forward_pass` kept), B runs on them instead of recomputing the forward."""
        args = [*jax.tree.leaves(params), h, g, *jax.tree.leaves(tuple(extras))]
        env = dict(zip(self.inputs, args))
        self._run(self._on_kept(self.b_nodes, env, kept), env)
        read = lambda a: a.val if isinstance(a, _Const) else env[a]  # noqa: E731
        axes = _joint_axes(h, g)
        saved = [jax.lax.convert_element_type(env[i], dtype) for i, (_, dtype) in zip(self.cut, self.cut_avals)]
        return read(self.dx), tuple(to_varying(saved, axes))

    def weight_pass(self, params, saved):
        """W: the weights' cotangents (a tree shaped as ``params``) from the ``saved`` cut values of B.

        Raises:
          AssertionError: ``saved`` not shaped as this split's cut (W traced a different program than B).
        """
        got = tuple((tuple(x.shape), x.dtype) for x in saved)
        if got != self.cut_avals:
            raise AssertionError(f"zero bubble's weight pass traced another cut: {got} != {self.cut_avals}")
        env = dict(zip(self.inputs[: self.n_params], jax.tree.leaves(params)))
        env.update(zip(self.cut, saved))
        self._run(self.w_nodes, env)
        read = lambda a: a.val if isinstance(a, _Const) else env[a]  # noqa: E731
        return self._weights_cotangent(read, params)

    def _on_kept(self, which, env: dict, kept) -> tuple[int, ...]:
        """The nodes of ``which`` still to run once ``kept`` (None: nothing kept) is in ``env``.

        Raises:
          AssertionError: ``kept`` not shaped as this split's `kept_avals` (the two ticks traced other programs).
        """
        if kept is None:
            return which
        got = tuple((tuple(x.shape), x.dtype) for x in kept)
        if got != self.kept_avals:
            raise AssertionError(f"the backward traced other kept residuals: {got} != {self.kept_avals}")
        env.update(zip(self.kept_cut, kept))
        skip = set(self.kept)
        return tuple(k for k in which if k not in skip)

    def forward_pass(self, params, h, extras):
        """The forward tick's part of the layer where residuals are kept: ``(y, kept)``, the layer's output
        ``[microbatch, ...]`` and the tuple of residuals ``kept_avals`` (cast varying as ``h``, as
        `kept_zeros` makes them)."""
        env = dict(zip(self.inputs, [*jax.tree.leaves(params), h]))
        env.update(zip(self.inputs[self.n_params + 2 :], jax.tree.leaves(tuple(extras))))
        self._run(self.forward_nodes, env)
        read = lambda a: a.val if isinstance(a, _Const) else env[a]  # noqa: E731
        kept = [jax.lax.convert_element_type(env[i], dtype) for i, (_, dtype) in zip(self.kept_cut, self.kept_avals)]
        return read(self.y), tuple(to_varying(kept, _joint_axes(h, h)))

    def backward_pass(self, params, h, kept, g, extras):
        """The backward tick's part where residuals are kept: ``(dw, dh)``, the weights' cotangents (a tree
        shaped as ``params``) and the input's ``[microbatch, ...]``, from ``kept`` (`forward_pass`'s) with no
        recomputation of the forward but a checkpoint region's (raises `_on_kept`'s AssertionError)."""
        args = [*jax.tree.leaves(params), h, g, *jax.tree.leaves(tuple(extras))]
        env = dict(zip(self.inputs, args))
        self._run(self._on_kept(tuple(sorted({*self.b_nodes, *self.w_nodes})), env, kept), env)
        read = lambda a: a.val if isinstance(a, _Const) else env[a]  # noqa: E731
        return self._weights_cotangent(read, params), read(self.dx)

    def _weights_cotangent(self, read, params):
        leaves = []
        for a, p in zip(self.dw, jax.tree.leaves(params)):
            d = read(a)
            if not hasattr(d, "shape") or tuple(d.shape) != tuple(p.shape):
                d = jax.numpy.broadcast_to(jax.numpy.asarray(d, p.dtype), p.shape)
            leaves.append(d)
        return jax.tree.unflatten(self.params_tree, leaves)

    @property
    def kept_bytes(self) -> int:
        """Bytes of one layer's kept residuals (`kept_avals`)."""
        import numpy as np

        return sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in self.kept_avals)

    def kept_zeros(self, h):
        """Zeros shaped as the kept residuals (an idle slot's), typed as `forward_pass` types them for ``h``."""
        return tuple(to_varying([jax.numpy.zeros(shape, dtype) for shape, dtype in self.kept_avals], _joint_axes(h, h)))

    def zeros(self, h, g):
        """Zeros shaped as the cut (an idle pass's ``saved``), typed as `input_pass` types it for ``h``, ``g``."""
        return tuple(to_varying([jax.numpy.zeros(shape, dtype) for shape, dtype in self.cut_avals], _joint_axes(h, g)))


#: Primitives of the weight-gradient products: what W is for (Qi et al., section 2: ``dw = x^T dy``).
_PRODUCTS = frozenset({"dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated"})


def _kept(nodes, backward: set[int], n_params: int, tangent: set[int], cut, outs, y, needed):
    """``(kept, forward_nodes, kept_cut)`` of `LayerSplit` (see its attributes): the nodes of ``backward`` (B and
    W) that depend on the layer's input (value id ``n_params``), not on the output's cotangent (``tangent``),
    and are no checkpoint region's; what the forward tick runs; what they hand the backward, in order."""
    h_dep = {n_params}
    for node in nodes:
        if any(isinstance(a, int) and a in h_dep for a in node.inputs):
            h_dep.update(node.outputs)
    kept = {
        k
        for k in backward
        if h_dep.intersection(nodes[k].outputs)
        and not tangent.intersection(nodes[k].outputs)
        and not nodes[k].recomputed
    }
    made = {i: k for k in kept for i in nodes[k].outputs}
    kept_cut: list[int] = []
    reads = [a for k in sorted(backward - kept) for a in nodes[k].inputs] + list(cut) + list(outs)
    for a in reads:
        if isinstance(a, int) and a in made and a not in kept_cut:
            kept_cut.append(a)
    forward = needed([y, *kept_cut])
    return tuple(sorted(kept)), tuple(sorted(forward)), tuple(kept_cut)


def _cut(nodes, w, dw, weight_inputs) -> list[int]:
    """The value ids the W nodes ``w`` read that they do not make (nor are weights), then the weight cotangents
    ``dw`` W does not make: what B hands over, in a fixed order."""
    made_in_w = {i for k in w for i in nodes[k].outputs}
    cut: list[int] = []
    reads = [a for k in sorted(w) for a in nodes[k].inputs] + list(dw)
    for a in reads:
        if isinstance(a, int) and a not in made_in_w and a not in weight_inputs and a not in cut:
            cut.append(a)
    return cut


def _not_products(nodes, w, carried, avals) -> set[int]:
    """The W nodes that run no weight-gradient product and read none's result, and that are no larger than
    what they read (a reduction, an elementwise product, a transpose; not a broadcast or an upcast), in
    order, whose other operands are all B's or such nodes' (``carried``: the values that depend on the
    activations or the output's cotangent, which B has): B can run them on what it has in hand."""
    after = set()  # results of the W products and of everything that reads them
    for k in sorted(w):
        node = nodes[k]
        reads = [a for a in node.inputs if isinstance(a, int)]
        if any(a in after for a in reads) or (node.primitive.name in _PRODUCTS and carried.intersection(reads)):
            after.update(node.outputs)
    made_in_w = {i for k in w for i in nodes[k].outputs}
    moved: set[int] = set()
    movable: set[int] = set()
    for k in sorted(w):
        node = nodes[k]
        if node.outputs[0] in after or not carried.intersection(node.outputs):
            continue
        reads = [a for a in node.inputs if isinstance(a, int) and a in carried]
        if any(a in made_in_w and a not in movable for a in reads):
            continue
        if _bytes(node.outputs, avals) <= _bytes(set(reads), avals):
            moved.add(k)
            movable.update(node.outputs)
    return moved


def _bytes(ids, avals) -> int:
    """Bytes of the values ``ids`` (each counted once)."""
    import numpy as np

    return sum(int(np.prod(avals[i].shape)) * np.dtype(avals[i].dtype).itemsize for i in set(ids))


def _joint_axes(h, g) -> tuple[str, ...]:
    """The manual axes ``h`` or ``g`` vary over, sorted."""
    return tuple(sorted(varying_axes(h) | varying_axes(g)))
