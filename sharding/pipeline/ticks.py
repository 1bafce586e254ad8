"""The tick tables of the 1F1B-family schedules: what each stage runs at each tick of one SPMD loop (no JAX).

Both tables run the order of PipeDream-Flush (Narayanan et al., "Efficient Large-Scale Language Model
Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2, figure 4; interleaved over ``R`` chunks per
stage, section 2.2.2, with virtual stages ``v = r*S + s``): each stage takes its microbatches' forwards in
order and their backwards in order, each as soon as its input is there. A forward's input left the previous
virtual stage at an earlier tick (the ``ppermute`` between ticks); a backward's cotangent left the next
virtual stage at an earlier tick, or, on the last virtual stage, comes from the loss of its own forward
(the head runs inside the loop).

* `one_f_one_b_ticks` (`Ticks`), lockstep: a stage runs one op per tick, a chunk's forward or its
  backward; with one chunk a step takes ``2 (M + S - 1)`` ticks, each as long as a backward, and a stage
  holds at most ``S`` microbatches' inputs.
* `fused_ticks` (`FusedTicks`), fused: a stage runs a forward and a backward in each tick (either may be
  idle), so in steady state one forward of a newer microbatch beside one backward of an older one. Every
  op then runs at the first tick its input allows, and a step takes ``R*M + (R+1) S - 2`` ticks
  (``M + 2 (S - 1)`` with one chunk) of a chunk's forward plus backward. The price is memory: an
  activation moves one virtual stage per tick each way, so a microbatch's input waits ``2 (V - 1 - v)``
  ticks on virtual stage ``v`` (``V = R*S``) between its forward and its backward, and stage ``s`` holds up
  to ``(R+1) S - 1 - 2s`` chunk inputs (``2 (S - s) - 1`` with one chunk: stage 0 ``2S - 1``, the last
  stage 1) where lockstep holds ``S``. No schedule of these ticks does better: stage 0's last backward
  waits for the chain of ``2 (S - 1)`` hops behind its last forward, so finishing in ``M + 2 (S - 1)``
  ticks forces a forward on stage 0 at every one of its first ``M`` ticks, ``2S - 1`` of them before its
  first backward; holding only ``S`` would bring back lockstep's ``~2M`` ticks.

* `zero_bubble_ticks` (`ZeroBubbleTicks`), zero bubble (ZB-H1, Qi et al., ICLR 2024): fused ticks whose
  backward is split into the input gradient (B, at fused 1F1B's backward ticks) and the weight gradient
  (W), which waits where its tick has room, each stage holding at most one of B's cuts (by default);
  ``M + 2 (S - 1)`` ticks, fused 1F1B's ring of chunk inputs and a second ring of one entry.

A table fixes the slot of every saved chunk input and of every waiting cotangent, so the loop only indexes;
`tick_time` prices a table with every tick as long as its busiest stage (the cost model's clock).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from sharding.errors import ConfigError, Field

FORWARD, BACKWARD, WEIGHT = 1, 2, 3
"""The ops of the tables (0: idle); `WEIGHT`, the weight-gradient pass, only in `ZeroBubbleTicks`."""


@dataclasses.dataclass(frozen=True)
class Ticks:
    """The 1F1B schedule as tables ``[ticks, S]`` int32: what each stage does at each tick of one SPMD loop.

    PipeDream-Flush (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", SC'21, section 2.2, figure 4) with ``R`` chunks per stage (virtual stages
    ``v = r*S + s``; interleaved, section 2.2.2, for ``R > 1``), in lockstep ticks of one op
    (`one_f_one_b_ticks`). Saved chunk inputs live in a ring of `slots` entries, cotangents waiting for
    their backward in one of `cotangent_slots`; the slot of each is fixed here, so the program only indexes.

    Attributes:
      op: 0 idle, `FORWARD` or `BACKWARD`.
      chunk: the op's chunk ``r`` (0 when idle).
      microbatch: the op's microbatch (0 when idle).
      slot: the ring slot of the op's saved chunk input (its slot inputs, written by the forward, read by
        the backward).
      arrive: the ring slot for the activation arriving at the start of the tick (sent by the previous
        virtual stage's forward at the tick before), -1 when what arrives is a dummy.
      cotangent_arrive: the cotangent slot for the cotangent arriving at the start of the tick (sent by the
        next virtual stage's backward at the tick before), -1 when it is a dummy.
      cotangent_slot: a backward's cotangent slot; for the last virtual stage's forward, the slot the loss's
        cotangent goes to.
      slots: ring slots per stage.
      cotangent_slots: cotangent slots per stage.
    """

    op: np.ndarray
    chunk: np.ndarray
    microbatch: np.ndarray
    slot: np.ndarray
    arrive: np.ndarray
    cotangent_arrive: np.ndarray
    cotangent_slot: np.ndarray
    slots: int
    cotangent_slots: int

    @property
    def ticks(self) -> int:
        return self.op.shape[0]

    def live(self) -> np.ndarray:
        """``[S]``: the most chunk inputs each stage holds at once (from arrival to backward)."""
        return _held(self.arrive, self.op == FORWARD, self.slot, self.op == BACKWARD, self.slot)

    def columns(self) -> dict[str, np.ndarray]:
        """The table as the loop reads it (`FusedTicks.columns`): a tick's forward and backward columns are
        the same arrays (``op`` for both: a forward runs where it is `FORWARD`, a backward where it is
        `BACKWARD`), so at most one of the two runs."""
        return {
            "forward": self.op,
            "forward_chunk": self.chunk,
            "forward_microbatch": self.microbatch,
            "forward_slot": self.slot,
            "backward": self.op,
            "backward_chunk": self.chunk,
            "backward_microbatch": self.microbatch,
            "backward_slot": self.slot,
            "arrive": self.arrive,
            "cotangent_arrive": self.cotangent_arrive,
            "cotangent_slot": self.cotangent_slot,
            "loss_slot": self.cotangent_slot,
        }


@dataclasses.dataclass(frozen=True)
class FusedTicks:
    """The fused 1F1B schedule as tables ``[ticks, S]`` int32: each stage's forward and backward at each tick.

    `fused_ticks` builds it (module docstring). The loop runs a tick's forward first, then the head when the
    forward is the last virtual stage's, then the backward, so the last virtual stage's backward of a
    microbatch may share the tick of its forward.

    Attributes:
      forward: `FORWARD` where the stage runs a chunk's forward at the tick, else 0.
      forward_chunk, forward_microbatch: the forward's chunk ``r`` and microbatch (0 when idle).
      forward_slot: the ring slot the forward's chunk input sits in (its slot inputs, written by the
        forward, read by the backward).
      backward: `BACKWARD` where the stage runs a chunk's backward at the tick, else 0 (the op codes of
        `Ticks`, so that the loop reads both tables alike).
      backward_chunk, backward_microbatch, backward_slot: likewise for the backward.
      arrive: the ring slot for the activation arriving at the start of the tick (sent by the previous
        virtual stage's forward at the tick before), -1 when what arrives is a dummy.
      cotangent_arrive: the cotangent slot for the cotangent arriving at the start of the tick (sent by the
        next virtual stage's backward at the tick before), -1 when it is a dummy.
      cotangent_slot: the backward's cotangent slot.
      loss_slot: for the last virtual stage's forward, the cotangent slot its loss's cotangent goes to.
      slots: ring slots per stage.
      cotangent_slots: cotangent slots per stage.
    """

    forward: np.ndarray
    forward_chunk: np.ndarray
    forward_microbatch: np.ndarray
    forward_slot: np.ndarray
    backward: np.ndarray
    backward_chunk: np.ndarray
    backward_microbatch: np.ndarray
    backward_slot: np.ndarray
    arrive: np.ndarray
    cotangent_arrive: np.ndarray
    cotangent_slot: np.ndarray
    loss_slot: np.ndarray
    slots: int
    cotangent_slots: int

    @property
    def ticks(self) -> int:
        return self.forward.shape[0]

    def live(self) -> np.ndarray:
        """``[S]``: the most chunk inputs each stage holds at once (from arrival to backward)."""
        return _held(
            self.arrive, self.forward == FORWARD, self.forward_slot, self.backward == BACKWARD, self.backward_slot
        )

    def columns(self) -> dict[str, np.ndarray]:
        """The columns the loop reads, by field name (the int32 ``[ticks, S]`` tables)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("slots", "cotangent_slots", "saved_slots")
        }


@dataclasses.dataclass(frozen=True)
class ZeroBubbleTicks(FusedTicks):
    """The zero-bubble schedule (ZB-H1) as tables ``[ticks, S]`` int32: `zero_bubble_ticks` builds it.

    A `FusedTicks` table whose ``backward`` is the input-gradient pass only (B: the cotangent of the chunk's
    input, on the critical path), plus a weight-gradient pass (W) per stage per tick. The loop runs a tick's
    forward, the head, B, then W. The ring of `slots` chunk inputs is fused 1F1B's (an input is freed by its
    B); a second ring of `saved_slots` entries holds what each B leaves for its W (each product's input and
    output cotangent, `sharding.pipeline.split`), from B to W.

    Attributes:
      weight: `WEIGHT` where the stage runs a chunk's weight-gradient pass at the tick, else 0.
      weight_chunk, weight_microbatch: the W pass's chunk and microbatch (0 when idle).
      weight_saved: the saved ring's entry the W pass reads.
      backward_saved: the saved ring's entry B writes.
      saved_slots: entries of the saved ring.
      (others as `FusedTicks`)
    """

    weight: np.ndarray
    weight_chunk: np.ndarray
    weight_microbatch: np.ndarray
    weight_saved: np.ndarray
    backward_saved: np.ndarray
    saved_slots: int

    def saved_live(self) -> np.ndarray:
        """``[S]``: the most saved-ring entries each stage holds at once (from its B, within the tick before
        its W reads it, to that W)."""
        ticks, stages = self.arrive.shape
        most = []
        for s in range(stages):
            held: set[int] = set()
            peak = 0
            for t in range(ticks):
                if self.backward[t, s]:
                    held.add(int(self.backward_saved[t, s]))
                peak = max(peak, len(held))
                if self.weight[t, s]:
                    held.discard(int(self.weight_saved[t, s]))
            most.append(peak)
        return np.asarray(most, np.int32)


def _held(arrive, forward, forward_slot, backward, backward_slot) -> np.ndarray:
    """``[S]``: per stage, the most ring slots in use at once: a slot is taken from its input's arrival (or
    the first virtual stage's forward) to the end of the tick of its backward."""
    ticks, stages = arrive.shape
    most = []
    for s in range(stages):
        held: set[int] = set()
        peak = 0
        for t in range(ticks):
            if arrive[t, s] >= 0:
                held.add(int(arrive[t, s]))
            if forward[t, s]:
                held.add(int(forward_slot[t, s]))
            peak = max(peak, len(held))
            if backward[t, s]:
                held.discard(int(backward_slot[t, s]))
        most.append(peak)
    return np.asarray(most, np.int32)


def _op_orders(stages: int, repeats: int, microbatches: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(forwards, backwards)``: the ``(chunk, microbatch)`` of every stage's forwards and backwards in order
    (Megatron-LM's order: with ``R > 1`` microbatches go in groups of ``S``, chunk by chunk, forwards in chunk
    order and backwards in reverse); the same on every stage."""

    def forward(k):
        group, within = divmod(k, stages * repeats)
        return within // stages, group * stages + within % stages

    forwards = [forward(k) for k in range(repeats * microbatches)]
    return forwards, [(repeats - 1 - r, i) for r, i in forwards]


def _stage_orders(stages: int, repeats: int, microbatches: int) -> list[list[tuple[int, int, int]]]:
    """Each stage's ops ``(op, chunk, microbatch)`` in order for lockstep ticks: warm-up forwards, then one
    forward and one backward alternately, then the remaining backwards (`_op_orders`)."""
    n = repeats * microbatches
    forwards, backwards = _op_orders(stages, repeats, microbatches)
    orders = []
    for s in range(stages):
        warm = stages - s - 1 if repeats == 1 else 2 * (stages - s - 1) + (repeats - 1) * stages
        warm = min(warm, n)
        order = [(FORWARD, *forwards[k]) for k in range(warm)]
        for k in range(n - warm):
            order += [(FORWARD, *forwards[warm + k]), (BACKWARD, *backwards[k])]
        order += [(BACKWARD, *backwards[k]) for k in range(n - warm, n)]
        orders.append(order)
    return orders


def _colour(intervals: dict) -> tuple[dict, int]:
    """Slots for inclusive tick intervals ``key -> (start, end)``: no two overlapping intervals share one."""
    slots, free_at = {}, []
    for key, (start, end) in sorted(intervals.items(), key=lambda kv: kv[1]):
        slot = next((k for k, t in enumerate(free_at) if t < start), len(free_at))
        if slot == len(free_at):
            free_at.append(end)
        free_at[slot] = end
        slots[key] = slot
    return slots, max(len(free_at), 1)


def one_f_one_b_ticks(stages: int, microbatches: int, repeats: int = 1) -> Ticks:
    """The 1F1B schedule of ``S`` stages, ``M`` microbatches and ``R`` chunks per stage, as a `Ticks` table.

    Each stage takes its next op (`_stage_orders`) as soon as its input is there: a forward's activation
    left the previous virtual stage at an earlier tick, a backward's cotangent left the next virtual stage
    at an earlier tick (the last virtual stage's: its own forward, the loss between them). With ``R = 1``
    stage ``s`` runs ``S - s`` forwards before its first backward and then alternates, holding at most ``S``
    microbatches' inputs (stage 0), and the pass takes ``2 (M + S - 1)`` ticks.

    Raises:
      ValueError: ``M < S``, or ``R > 1`` with ``M`` not a multiple of ``S`` (the interleaved order moves
        microbatches in groups of ``S``), naming the field ``microbatches``.
    """
    _check(stages, microbatches, repeats)
    last = stages * repeats - 1
    orders, done, ptr, rows = _stage_orders(stages, repeats, microbatches), {}, [0] * stages, []
    while any(p < len(o) for p, o in zip(ptr, orders)):
        row = []
        for s in range(stages):
            if ptr[s] == len(orders[s]):
                row.append(None)
                continue
            op, r, i = orders[s][ptr[s]]
            v = r * stages + s
            need = (
                ((FORWARD, v - 1, i) if v else None)
                if op == FORWARD
                else ((FORWARD, v, i) if v == last else (BACKWARD, v + 1, i))
            )
            ready = need is None or done.get(need, len(rows)) < len(rows)
            row.append((op, r, i) if ready else None)
            ptr[s] += ready
        for s, entry in enumerate(row):
            if entry:
                done[entry[0], entry[1] * stages + s, entry[2]] = len(rows)
        rows.append(row)
        if len(rows) > 4 * (repeats * microbatches + stages) * 2:
            raise AssertionError("1F1B order deadlocked")  # unreachable for the orders above
    saved, waiting = _intervals(done, stages, microbatches, last)
    by_stage = [{k: w for k, w in saved.items() if k[0] % stages == s} for s in range(stages)]
    cot_by_stage = [{k: w for k, w in waiting.items() if k[0] % stages == s} for s in range(stages)]
    colours = [_colour(x) for x in by_stage]
    cot_colours = [_colour(x) for x in cot_by_stage]
    slot_of = {k: c for cs, _ in colours for k, c in cs.items()}
    cot_of = {k: c for cs, _ in cot_colours for k, c in cs.items()}
    shape = (len(rows), stages)
    tables = {name: np.zeros(shape, np.int32) for name in ("op", "chunk", "microbatch", "slot", "cotangent_slot")}
    tables["arrive"] = np.full(shape, -1, np.int32)
    tables["cotangent_arrive"] = np.full(shape, -1, np.int32)
    for t, row in enumerate(rows):
        for s, entry in enumerate(row):
            if not entry:
                continue
            op, r, i = entry
            v = r * stages + s
            for name, value in (("op", op), ("chunk", r), ("microbatch", i), ("slot", slot_of[v, i])):
                tables[name][t, s] = value
            if op == BACKWARD or v == last:
                tables["cotangent_slot"][t, s] = cot_of[v, i]
            if op == FORWARD and v < last and t + 1 < len(rows):
                tables["arrive"][t + 1, (s + 1) % stages] = slot_of[v + 1, i]
            if op == BACKWARD and v > 0 and t + 1 < len(rows):
                tables["cotangent_arrive"][t + 1, (s - 1) % stages] = cot_of[v - 1, i]
    return Ticks(**tables, slots=max(n for _, n in colours), cotangent_slots=max(n for _, n in cot_colours))


def _fused_order(stages: int, microbatches: int, repeats: int) -> tuple[list, dict]:
    """``(rows, done)`` of `fused_ticks`: per tick and stage the ``(forward, backward)`` run, each a ``(chunk,
    microbatch)`` or None, and the tick of every ``(op, virtual stage, microbatch)``.

    Raises:
      ValueError: as `_check`.
    """
    _check(stages, microbatches, repeats)
    last, n = stages * repeats - 1, repeats * microbatches
    forwards, backwards = _op_orders(stages, repeats, microbatches)
    done: dict[tuple[int, int, int], int] = {}
    ptr = [[0, 0] for _ in range(stages)]
    rows = []
    while any(p < n for pair in ptr for p in pair):
        t, row = len(rows), []
        for s in range(stages):
            forward = backward = None
            if ptr[s][0] < n:
                r, i = forwards[ptr[s][0]]
                v = r * stages + s
                if v == 0 or done.get((FORWARD, v - 1, i), t) < t:
                    forward, ptr[s][0] = (r, i), ptr[s][0] + 1
            if ptr[s][1] < n:
                r, i = backwards[ptr[s][1]]
                v = r * stages + s
                ready = (
                    ((FORWARD, v, i) in done or forward == (r, i))
                    if v == last
                    else done.get((BACKWARD, v + 1, i), t) < t
                )
                if ready:
                    backward, ptr[s][1] = (r, i), ptr[s][1] + 1
            row.append((forward, backward))
        for s, (forward, backward) in enumerate(row):
            for op, entry in ((FORWARD, forward), (BACKWARD, backward)):
                if entry:
                    done[op, entry[0] * stages + s, entry[1]] = t
        rows.append(row)
        if len(rows) > 4 * (n + stages) * 2:
            raise AssertionError("fused 1F1B order deadlocked")  # unreachable for the orders above
    return rows, done


def fused_ticks(stages: int, microbatches: int, repeats: int = 1) -> FusedTicks:
    """The fused 1F1B schedule of ``S`` stages, ``M`` microbatches and ``R`` chunks per stage (module docstring).

    At each tick each stage takes its next forward if its input is there and its next backward if its
    cotangent is there (`_op_orders`; the last virtual stage's backward may follow its forward within the
    tick). Every op then runs at the first tick its dependencies allow: the forward of virtual stage ``v``
    of microbatch ``i = g*S + j`` (group ``g``) at tick ``g*R*S + v + j``, and the step takes ``R*M + (R+1) S
    - 2`` ticks.

    Raises:
      ValueError: as `one_f_one_b_ticks` (``M < S``; ``R > 1`` with ``M`` not a multiple of ``S``).
    """
    _check(stages, microbatches, repeats)
    last = stages * repeats - 1
    rows, done = _fused_order(stages, microbatches, repeats)
    saved, waiting = _intervals(done, stages, microbatches, last)
    colours = [_colour({k: w for k, w in saved.items() if k[0] % stages == s}) for s in range(stages)]
    cot_colours = [_colour({k: w for k, w in waiting.items() if k[0] % stages == s}) for s in range(stages)]
    slot_of = {k: c for cs, _ in colours for k, c in cs.items()}
    cot_of = {k: c for cs, _ in cot_colours for k, c in cs.items()}
    tables = _fused_tables(rows, stages, last, slot_of, cot_of)
    return FusedTicks(**tables, slots=max(n for _, n in colours), cotangent_slots=max(n for _, n in cot_colours))


def _fused_tables(rows: list, stages: int, last: int, slot_of: dict, cot_of: dict) -> dict[str, np.ndarray]:
    """The ``[ticks, S]`` int32 columns of `FusedTicks` (all but the slot counts) from `_fused_order`'s rows, the
    ring slot of every ``(v, i)`` chunk input and the cotangent slot of every waiting cotangent."""
    shape = (len(rows), stages)
    names = (
        "forward",
        "forward_chunk",
        "forward_microbatch",
        "forward_slot",
        "backward",
        "backward_chunk",
        "backward_microbatch",
        "backward_slot",
        "cotangent_slot",
        "loss_slot",
    )
    tables = {name: np.zeros(shape, np.int32) for name in names}
    tables["arrive"] = np.full(shape, -1, np.int32)
    tables["cotangent_arrive"] = np.full(shape, -1, np.int32)
    for t, row in enumerate(rows):
        for s, (forward, backward) in enumerate(row):
            if forward:
                r, i = forward
                v = r * stages + s
                for name, value in (("", FORWARD), ("_chunk", r), ("_microbatch", i), ("_slot", slot_of[v, i])):
                    tables["forward" + name][t, s] = value
                if v == last:
                    tables["loss_slot"][t, s] = cot_of[v, i]
                elif t + 1 < len(rows):
                    tables["arrive"][t + 1, (s + 1) % stages] = slot_of[v + 1, i]
            if backward:
                r, i = backward
                v = r * stages + s
                for name, value in (("", BACKWARD), ("_chunk", r), ("_microbatch", i), ("_slot", slot_of[v, i])):
                    tables["backward" + name][t, s] = value
                tables["cotangent_slot"][t, s] = cot_of[v, i]
                if v > 0 and t + 1 < len(rows):
                    tables["cotangent_arrive"][t + 1, (s - 1) % stages] = cot_of[v - 1, i]
    return tables


def fused_tick_count(stages: int, microbatches: int, repeats: int = 1) -> int:
    """``R*M + (R+1) S - 2``: the ticks of `fused_ticks` (``M + 2 (S - 1)`` with one chunk per stage)."""
    return repeats * microbatches + (repeats + 1) * stages - 2


def fused_held_bound(stages: int, microbatches: int, repeats: int, stage: int) -> int:
    """The most chunk inputs stage ``stage`` holds under `fused_ticks`: ``min(R*M, (R+1) S - 1 - 2 stage)``
    (a microbatch's input waits ``2 (V - 1 - v)`` ticks between its forward and its backward on virtual stage
    ``v``, while one forward a tick arrives)."""
    return min(repeats * microbatches, (repeats + 1) * stages - 1 - 2 * stage)


def zero_bubble_ticks(stages: int, microbatches: int, repeats: int = 1, ring: int = 1) -> ZeroBubbleTicks:
    """The ZB-H1 schedule of ``S`` stages and ``M`` microbatches as a `ZeroBubbleTicks` table.

    Qi et al., "Zero Bubble Pipeline Parallelism" (ICLR 2024), section 3: the backward pass is split into B,
    the input's cotangent, which the previous stage waits for, and W, the weights' cotangent, which nothing
    waits for. Forwards and B passes run at the ticks of `fused_ticks` (each at the first tick its input
    allows, so a step still takes ``M + 2 (S - 1)`` ticks); the W passes fill what the ticks leave
    (`_weight_ticks`): a stage runs at most one W a tick, after its B, and holds at most ``ring`` sets of what
    B leaves for W (ZB-H1's memory bound, counted in those sets), so a W waits only where its tick has room.
    With ``ring`` 1 a step costs ``4 (M + S - 1) - 1`` forward-equivalents of the clock (`tick_time`, F 1,
    B 2, W 1), one less than fused 1F1B and GPipe: the last stages' last W passes leave the drain, where
    stage 0's B passes are the critical path. What stage ``s`` holds: fused 1F1B's ``2 (S - s) - 1`` chunk
    inputs (each until its B) and ``ring`` sets of B's cut (`saved_slots`).

    Args:
      stages, microbatches, repeats: ``S``, ``M``, ``R`` (1 only).
      ring: the most cuts a stage holds at once (the saved ring's entries); ``c < S`` buys ``c`` clock units
        (``4 (M + S - 1) - c``), with extra W-only ticks at the end for ``c > 1``.

    Raises:
      ValueError: ``R > 1`` (ZB-H1 runs one chunk per stage; the interleaved ZB-V is not built), naming
        the field ``pipeline_repeats``; as `fused_ticks` (``M < S``), naming ``microbatches``; ``ring`` < 1.
    """
    if repeats != 1:
        raise ConfigError(
            Field("pipeline_repeats", repeats),
            ": ",
            Field("pipeline_schedule", "zb"),
            " runs one chunk per stage (ZB-H1); use ",
            Field("pipeline_repeats", 1),
            ", or ",
            Field("pipeline_schedule", "1f1b-fused"),
            " for interleaved chunks",
        )
    if ring < 1:
        raise ValueError(f"zero bubble's saved ring needs at least 1 entry, got {ring}")
    _check(stages, microbatches, 1)
    last = stages - 1
    rows, done = _fused_order(stages, microbatches, 1)
    when = _weight_ticks(rows, done, stages, ring)
    rows += [[(None, None)] * stages for _ in range(max(when.values()) + 1 - len(rows))]
    saved, waiting = _intervals(done, stages, microbatches, last)
    kept = {(s, i): (done[BACKWARD, s, i], w) for (s, i), w in when.items()}  # W reads after B within a tick
    colours = [_colour({k: w for k, w in saved.items() if k[0] == s}) for s in range(stages)]
    cot_colours = [_colour({k: w for k, w in waiting.items() if k[0] == s}) for s in range(stages)]
    kept_colours = [_colour({k: w for k, w in kept.items() if k[0] == s}) for s in range(stages)]
    slot_of = {k: c for cs, _ in colours for k, c in cs.items()}
    cot_of = {k: c for cs, _ in cot_colours for k, c in cs.items()}
    kept_of = {k: c for cs, _ in kept_colours for k, c in cs.items()}
    tables = _fused_tables(rows, stages, last, slot_of, cot_of)
    shape = tables["forward"].shape
    for name in ("weight", "weight_chunk", "weight_microbatch", "weight_saved", "backward_saved"):
        tables[name] = np.zeros(shape, np.int32)
    for (s, i), t in when.items():
        tables["weight"][t, s] = WEIGHT
        tables["weight_microbatch"][t, s] = i
        tables["weight_saved"][t, s] = kept_of[s, i]
        tables["backward_saved"][done[BACKWARD, s, i], s] = kept_of[s, i]
    return ZeroBubbleTicks(
        **tables,
        slots=max(n for _, n in colours),
        cotangent_slots=max(n for _, n in cot_colours),
        saved_slots=max(n for _, n in kept_colours),
    )


def _weight_ticks(rows: list, done: dict, stages: int, ring: int) -> dict[tuple[int, int], int]:
    """The tick of every W pass ``(stage, microbatch) -> tick`` of `zero_bubble_ticks`, tick by tick: a stage's
    B passes queue their W; it must run one where its queue, with the next tick's B, would exceed ``ring``
    cuts (at most one: B passes come one a tick), and runs one anyway where the tick has room (its forward
    and B, 1 and 2, plus the W fit under the busiest stage's work at that tick); after the last B, one a tick
    until the queue is empty (W-only ticks appended)."""
    pending: list[list[int]] = [[] for _ in range(stages)]
    backward_at = {(t, s): i for (op, s, i), t in done.items() if op == BACKWARD}
    base = {(t, s): 0 for t in range(len(rows)) for s in range(stages)}
    for (op, s, _), t in done.items():  # in forward-equivalents: the clock's F 1, B 2, W 1 (the planner's zb shares)
        base[t, s] += 1 if op == FORWARD else 2
    when, t = {}, 0
    while t < len(rows) or any(pending):
        must = []
        for s in range(stages):
            if (t, s) in backward_at:
                pending[s].append(backward_at[t, s])
            due = len(pending[s]) + ((t + 1, s) in backward_at) - ring
            must.append(bool(pending[s]) and (due > 0 or t >= len(rows) - 1))
        busiest = max(base.get((t, s), 0) + must[s] for s in range(stages))
        for s in range(stages):
            if pending[s] and (must[s] or base.get((t, s), 0) + 1 <= busiest):
                when[s, pending[s].pop(0)] = t
        t += 1
    return when


def tick_ops(table: Ticks | FusedTicks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(forward, backward, weight)``: bool ``[ticks, S]``, where each stage runs a chunk's forward, its
    backward (zero bubble: the input-gradient pass) and a weight-gradient pass (zero bubble only)."""
    if isinstance(table, Ticks):
        return table.op == FORWARD, table.op == BACKWARD, np.zeros(table.op.shape, bool)
    weight = table.weight == WEIGHT if isinstance(table, ZeroBubbleTicks) else np.zeros(table.forward.shape, bool)
    return table.forward == FORWARD, table.backward == BACKWARD, weight


def tick_time(table: Ticks | FusedTicks, forward, backward, weight=None) -> float:
    """The step's time when every tick lasts as long as its busiest stage: ``sum_t max_s`` of what stage ``s``
    runs at tick ``t`` (one SPMD program: the ``ppermute`` closing each tick waits for every stage).

    Args:
      table: a tick table.
      forward, backward, weight: ``[S]`` seconds (or any unit) of a chunk's forward, backward (zero bubble:
        input gradient) and weight gradient on each stage; ``weight`` None for the tables without one.

    Returns:
      The sum over ticks of the slowest stage's work, in the unit of the arguments.
    """
    f, b, w = tick_ops(table)
    load = f * np.asarray(forward, float) + b * np.asarray(backward, float)
    if weight is not None:
        load = load + w * np.asarray(weight, float)
    return float(load.max(axis=1).sum())


def _intervals(done: dict, stages: int, microbatches: int, last: int) -> tuple[dict, dict]:
    """``(saved, waiting)``: per ``(v, i)`` the inclusive ticks its chunk input is held (arrival to backward)
    and its cotangent waits (arrival, or the loss at the last virtual stage's forward, to backward)."""
    saved = {
        (v, i): (done[FORWARD, v - 1, i] + 1 if v else done[FORWARD, v, i], done[BACKWARD, v, i])
        for v in range(last + 1)
        for i in range(microbatches)
    }
    waiting = {
        (v, i): (done[FORWARD, v, i] if v == last else done[BACKWARD, v + 1, i] + 1, done[BACKWARD, v, i])
        for v in range(last + 1)
        for i in range(microbatches)
    }
    return saved, waiting


def _check(stages: int, microbatches: int, repeats: int) -> None:
    """The microbatch counts the 1F1B orders take.

    Raises:
      ValueError: ``M < S``, or ``R > 1`` with ``M`` not a multiple of ``S`` (the interleaved order moves
        microbatches in groups of ``S``), naming the field ``microbatches``.
    """
    if microbatches < stages:
        raise ConfigError(Field("microbatches", microbatches), f": 1F1B needs at least the {stages} stages")
    if repeats > 1 and microbatches % stages:
        raise ConfigError(
            Field("microbatches", microbatches),
            ": interleaved 1F1B (",
            Field("pipeline_repeats", repeats),
            f") needs a multiple of the {stages} stages, e.g. ",
            Field("microbatches", stages * -(-microbatches // stages)),
        )
