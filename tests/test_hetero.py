"""Uneven data parallelism: the update equals the uniform-batch one; each device runs its own count.

The optimizer uses ``eps=1e-3`` here: AdamW's first update is ``g / (|g| + eps)``, which for the
default ``eps=1e-8`` flips sign on gradient entries near zero under any change of summation order;
a larger eps keeps the update a smooth function of the gradient, so 1e-5 compares the gradients'
effect rather than float32 rounding of entries that are zero in exact arithmetic.
"""

import argparse
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from models.config import get_config
from sharding import costmodel as cm
from sharding import hlo
from sharding.devices import simulate_inventory
from sharding.mesh import make_mesh, parse_mesh
from sharding.rules import get_rules
from train import hetero
from train.optimizer import OptimizerConfig
from train.step import Trainer

SEQ = 32
COUNTS = (3, 3, 3, 3, 1, 1, 1, 1)


def _trainer(mesh_spec, rules):
    config = get_config("test", ["num_layers=1"])
    optimizer = OptimizerConfig(warmup=0, decay_steps=10, eps=1e-3)
    return Trainer(config, optimizer, make_mesh(parse_mesh(mesh_spec, 8)), get_rules(rules), 1)


def _batch(trainer, rows, seed=0):
    rng = np.random.default_rng(seed)
    fields = {
        "tokens": rng.integers(0, 512, (rows, SEQ)),
        "targets": rng.integers(0, 512, (rows, SEQ)),
        "positions": np.tile(np.arange(SEQ), (rows, 1)),
        "segment_ids": np.repeat(rng.integers(1, 3, (rows, 1)), SEQ, axis=1),
    }
    mask = (rng.random((rows, SEQ)) > 0.1).astype(np.float32)
    sharding = trainer.batch_sharding(rows, SEQ)
    batch = {k: jax.device_put(v.astype(np.int32), sharding) for k, v in fields.items()}
    batch["loss_mask"] = jax.device_put(mask, sharding)
    return batch


def _close(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-5)


def _loop_bodies(text):
    """Computations reachable from the body of a while loop whose trip count is not known."""
    instructions, calls, _ = hlo._parse(text)
    roots = []
    for items in instructions.values():
        for _, _, op, rest in items:
            if op == "while" and "known_trip_count" not in rest:
                roots += re.findall(r"\bbody=%?([\w.\-]+)", rest)
    seen, stack = set(), list(roots)
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack += [callee for callee, _ in calls.get(name, ())]
    return seen, instructions


@pytest.mark.parametrize("mesh_spec,rules,counts,rows", [
    ("data=8", "dp", COUNTS, 1),
    ("data=2,fsdp=4", "fsdp", (0, 2, 1, 1, 4, 1, 0, 3), 2),
])
def test_update_equals_uniform_batch_and_counts_match(mesh_spec, rules, counts, rows):
    trainer = _trainer(mesh_spec, rules)
    step = hetero.HeteroTrainer(trainer, counts, rows)
    batch_rows = sum(counts) * rows
    batch = _batch(trainer, batch_rows)
    params = trainer.init_state(0)["params"]

    loss_sum, weight, grads, processed = jax.jit(step.gradients)(params, batch)
    (u_loss, u_weight), uniform = jax.jit(jax.value_and_grad(trainer.loss_sums, has_aux=True))(params, batch)
    np.testing.assert_allclose(float(loss_sum), float(u_loss), rtol=1e-5)
    assert float(weight) == float(u_weight)
    _close(jax.tree.map(lambda g: g / weight, grads), jax.tree.map(lambda g: g / u_weight, uniform))
    assert np.asarray(processed).tolist() == list(counts)

    signals = trainer.signals(False)
    compiled = step.counted_step(batch_rows, SEQ).lower(trainer.init_state(0), batch, signals).compile()
    new, metrics, processed = compiled(trainer.init_state(0), batch, signals)
    ref, ref_metrics = trainer.train_step(batch_rows, SEQ)(trainer.init_state(0), batch, signals)
    assert np.asarray(processed).tolist() == list(counts)
    assert int(metrics["microbatches"]) == sum(counts)
    np.testing.assert_allclose(float(metrics["loss"]), float(ref_metrics["loss"]), rtol=1e-5)
    _close(new["params"], ref["params"])
    _close(new["opt_state"], ref["opt_state"])
    # the parameters moved: the comparison is not of two unchanged states
    assert max(float(jnp.max(jnp.abs(a - b))) for a, b in
               zip(jax.tree.leaves(new["params"]), jax.tree.leaves(params))) > 1e-4
    _check_compiled_loop(compiled.as_text(), trainer, mesh_spec, rules, counts, rows)


def _check_compiled_loop(text, trainer, mesh_spec, rules, counts, rows):
    """A collective inside a loop whose trip count differs per device would deadlock: the step's
    microbatch loop must exist with every collective outside it; and the collectives must be the
    cost model's for the uneven step."""
    bodies, instructions = _loop_bodies(text)
    assert bodies, "the per-device microbatch loop is missing"
    inside = [(c, op) for c in bodies for _, _, op, _ in instructions.get(c, ())
              if op.replace("-start", "") in hlo.COLLECTIVE_OPS]
    assert inside == []
    layout = cm.Layout(parse_mesh(mesh_spec, 8), rules, 1, uneven_batch=True)
    cost = cm.device_cost(trainer.config, layout, seq_len=SEQ, rows=rows, microbatches=max(counts), backend="cpu",
                          batch_rows=sum(counts) * rows)
    compiled, predicted = cm.collective_bytes(hlo.collectives(text)), cm.collective_bytes(cost.comms)
    assert set(compiled) == set(predicted)
    for kind in compiled:
        assert abs(predicted[kind] - compiled[kind]) <= 0.1 * compiled[kind], (kind, predicted, compiled)


def test_speed_counts_largest_remainder():
    assert hetero.speed_counts([989.5, 989.5, 989.5, 989.5, 312, 312, 312, 312], 16) == [3, 3, 3, 3, 1, 1, 1, 1]
    assert hetero.speed_counts([1, 1, 1], 10) == [4, 3, 3]
    assert hetero.speed_counts([2, 1], 0) == [0, 0]
    counts = hetero.speed_counts([3.0, 1.5, 1.0, 1.0], 37)
    assert sum(counts) == 37 and counts[0] > counts[1] > counts[2] == counts[3]
    with pytest.raises(ValueError):
        hetero.speed_counts([1, 0], 4)


def test_auto_counts_from_simulated_kinds():
    trainer = _trainer("data=8", "dp")
    _, simulated = simulate_inventory("h100:4,a100:4", jax.devices())
    speeds = hetero.device_speeds(trainer.mesh, simulated)
    assert hetero.parse_hetero_batch("auto", 8, 16, speeds) == list(COUNTS)
    with pytest.raises(ValueError, match="--simulate-cluster"):
        hetero.device_speeds(trainer.mesh, None)  # CPU devices: peak unknown


def test_bad_layouts_and_counts_are_refused_naming_the_flag():
    with pytest.raises(ValueError, match="--hetero-batch supports data-parallel meshes"):
        hetero.HeteroTrainer(_trainer("data=4,tensor=2", "dp"), (1, 1, 1, 1), 1)
    with pytest.raises(ValueError, match="8 devices"):
        hetero.HeteroTrainer(_trainer("data=8", "dp"), (1, 1), 1)
    with pytest.raises(ValueError, match="--batch-size 20"):
        hetero.HeteroTrainer(_trainer("data=8", "dp"), COUNTS, 1).train_step(20, SEQ)
    with pytest.raises(ValueError, match="sum to the 16"):
        hetero.parse_hetero_batch("3,3,3,3,1,1,1,2", 8, 16, None)
    args = argparse.Namespace(hetero_batch="3,x", plan=None, cluster=None, simulate_cluster=None)
    with pytest.raises(ValueError, match="--hetero-batch"):
        hetero.validate_flags(args)
    args = argparse.Namespace(hetero_batch="3,3,3,3,1,1,1,1", batch_size=20, mesh="data=8")
    with pytest.raises(ValueError, match="--batch-size 20"):
        hetero.check_flags(args, {"data": 8, "fsdp": 1})


def test_plan_auto_sets_the_flags(monkeypatch):
    args = argparse.Namespace(plan="auto", cluster=None, simulate_cluster="h100:4,a100:4", batch_size=64, seq_len=256,
                              mesh="fsdp=-1", rules="fsdp_tp", rule=[], microbatches=1, hetero_batch="off",
                              stage_layers=None, pipeline_schedule="gpipe", pipeline_repeats=None)
    lines = []
    config = hetero.apply_plan(args, get_config("125m", attention="flash", dtype="bfloat16"), jax.devices(), lines.append)
    assert lines and lines[0].startswith("--plan auto")
    shape = parse_mesh(args.mesh, 8)
    assert args.rules in ("dp", "fsdp", "tp", "fsdp_tp") and args.microbatches >= 1
    assert config.remat in ("none", "dots", "full")
    if args.hetero_batch != "off":
        hetero.check_flags(args, shape)
    if shape["stage"] > 1:
        assert sum(int(x) for x in args.stage_layers.split(",")) == 12


def test_cli_dry_run_with_simulated_cluster_and_auto_counts(capsys):
    from train.train import main

    code = main(["--cpu-devices", "8", "--model", "test", "--set", "num_layers=1", "--mesh", "data=8", "--rules", "dp",
                 "--simulate-cluster", "h100:4,a100:4", "--hetero-batch", "auto", "--microbatches", "2",
                 "--batch-size", "16", "--seq-len", "32", "--dry-run"])
    out = capsys.readouterr().out
    assert code == 0
    assert "per device 3 (990 TFLOP/s), 3 (990 TFLOP/s), 3 (990 TFLOP/s), 3 (990 TFLOP/s), 1 (312 TFLOP/s)" in out
    assert "collectives in the compiled step" in out


def test_cli_refuses_uneven_batch_on_a_tensor_mesh(capsys):
    from train.train import main

    code = main(["--cpu-devices", "8", "--model", "test", "--mesh", "data=4,tensor=2", "--rules", "tp",
                 "--hetero-batch", "1,1,1,1", "--batch-size", "8", "--seq-len", "32", "--dry-run"])
    assert code == 2
    assert "--hetero-batch supports data-parallel meshes" in capsys.readouterr().err
