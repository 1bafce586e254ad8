"""Damaged checkpoints are found before a resume, the older complete step is chosen, inspect marks them."""

import json
import os
import shutil
import sys
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _cli_errors import as_printed, raises_as_cli
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from checkpoints import inspect as inspect_cli
from checkpoints.manager import CheckpointManager, open_resumable
from checkpoints.verify import (
    CheckpointDamaged,
    ResumeChoice,
    _expected_chunks,
    latest_verified_step,
    restore_falling_back,
    saved_steps,
    verify_step,
)
from models.config import ModelConfig
from sharding.mesh import make_mesh, parse_mesh

W = np.arange(64 * 64, dtype=np.float32).reshape(64, 64)  # 2 KiB chunks on fsdp=8: stored in data files


def tiny_state(mesh):
    sharding = NamedSharding(mesh, P("fsdp"))
    return {
        "w": jax.device_put(jnp.asarray(W), sharding),
        "opt": {"mu": jax.device_put(jnp.asarray(W) * 2, sharding)},
        "step": jnp.int32(7),
    }


def abstract(mesh):
    sharding = NamedSharding(mesh, P("fsdp"))
    return {
        "w": jax.ShapeDtypeStruct(W.shape, jnp.float32, sharding=sharding),
        "opt": {"mu": jax.ShapeDtypeStruct(W.shape, jnp.float32, sharding=sharding)},
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
    }


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A checkpoint folder with complete steps 1 and 2."""
    folder = tmp_path_factory.mktemp("verify") / "checkpoints"
    manager = CheckpointManager(folder, keep=5, async_save=False)
    try:
        for step in (1, 2):
            manager.save(step, tiny_state(make_mesh(parse_mesh("fsdp=8", 8))), {"step": step, "mesh": {"fsdp": 8}})
    finally:
        manager.close()
    return folder


@pytest.fixture
def copy(saved, tmp_path):
    target = tmp_path / "checkpoints"
    shutil.copytree(saved, target)
    return target


def data_file_of(state: Path, array: str) -> Path:
    """A per-process data file holding chunks of ``array`` (read from the OCDBT index): the one referenced
    furthest into it. Orbax may spread one array's chunks over several files (it does under jax 0.12)."""
    from checkpoints.verify import _walk_index

    _, references = _walk_index(state)
    files = {
        file: max(end for key, end in uses if key.startswith(f"{array}/"))
        for file, uses in references.items()
        if any(key.startswith(f"{array}/") for key, _ in uses)
    }
    assert files, references
    return state / max(files, key=lambda file: (files[file], file))


def truncate(path: Path, keep: int) -> None:
    path.write_bytes(path.read_bytes()[:keep])


def remove_btree_nodes(state: Path) -> None:
    for node in (state / "d").iterdir():
        node.unlink()


DAMAGES = {  # name: (how, phrase the verdict must contain)
    "meta item removed": (lambda s: shutil.rmtree(s / "meta"), "the meta item"),
    "state item removed": (lambda s: shutil.rmtree(s / "state"), "the state item"),
    "array data file removed": (lambda s: data_file_of(s / "state", "opt.mu").unlink(), "is missing (chunks of"),
    "array data file cut short": (lambda s: truncate(data_file_of(s / "state", "w"), 100), "is truncated (100 bytes"),
    "state metadata truncated": (lambda s: truncate(s / "state" / "_METADATA", 97), "_METADATA is not valid JSON"),
    "meta truncated": (lambda s: truncate(s / "meta" / "metadata", 9), "metadata is not valid JSON"),
    "array index node removed": (lambda s: remove_btree_nodes(s / "state"), "the array index in"),
    "array index manifest removed": (lambda s: (s / "state" / "manifest.ocdbt").unlink(), "manifest.ocdbt"),
    "array records not UTF-8": (
        lambda s: (s / "state" / "array_metadatas" / "process_0").write_bytes(b"\xff\xfe{"),
        "array_metadatas/process_0 is not valid JSON (not UTF-8 text: byte 0 is 0xff)",
    ),
    "sharding record truncated": (lambda s: truncate(s / "state" / "_sharding", 20), "_sharding is not valid JSON"),
}


def test_intact_steps_verify_and_restore_the_saved_values(saved):
    assert saved_steps(saved) == [1, 2]
    assert all(verify_step(saved, s).ok for s in (1, 2))
    assert latest_verified_step(saved) == ResumeChoice(2)
    assert latest_verified_step(saved, explicit=1) == ResumeChoice(1)
    manager = CheckpointManager(saved, async_save=False)
    try:
        assert manager.resume_choice() == ResumeChoice(2)
        state, meta = manager.restore(abstract(make_mesh(parse_mesh("data=2,fsdp=4", 8))), step=2)
    finally:
        manager.close()
    assert meta == {"step": 2, "mesh": {"fsdp": 8}}
    np.testing.assert_array_equal(np.asarray(state["w"]), W)
    np.testing.assert_array_equal(np.asarray(state["opt"]["mu"]), W * 2)


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_each_damage_is_named_and_the_older_complete_step_is_chosen(copy, damage):
    how, phrase = DAMAGES[damage]
    how(copy / "2")
    verdict = verify_step(copy, 2)
    assert not verdict.ok and phrase in verdict.line(), verdict
    assert "\n" not in verdict.line() and "step 2" in verdict.line()
    assert verify_step(copy, 1).ok
    choice = latest_verified_step(copy)
    assert choice.step == 1
    assert len(choice.notes) == 1 and choice.notes[0].startswith("skipped step 2") and phrase in choice.notes[0]
    assert choice.notes[0].endswith("resuming from step 1")
    with raises_as_cli(CheckpointDamaged, match=r"^--resume-step 2: step 2 .*; pass --resume-step 1$"):
        latest_verified_step(copy, explicit=2)


def test_a_removed_data_file_really_breaks_orbax_and_the_verdict_names_it(copy):
    """The damage the verdict reports is one Orbax's restore fails on (so the check is not a false alarm)."""
    lost = data_file_of(copy / "2" / "state", "w")
    lost.unlink()
    verdict = verify_step(copy, 2)
    # the file may also hold chunks of other arrays (Orbax packs them as its writers go): all are named
    (problem,) = verdict.problems
    assert problem.startswith(f"data file {lost} is missing (chunks of array") and "'w'" in problem, problem
    manager = CheckpointManager(copy, async_save=False)
    try:
        with pytest.raises(Exception):  # noqa: B017 (whatever Orbax raises on the damaged step)
            manager.restore(abstract(make_mesh(parse_mesh("fsdp=8", 8))), step=2)
        state, _ = manager.restore(abstract(make_mesh(parse_mesh("fsdp=8", 8))), step=1)
    finally:
        manager.close()
    np.testing.assert_array_equal(np.asarray(state["w"]), W)


def test_explicit_and_exhausted_choices_are_errors(copy, tmp_path):
    with raises_as_cli(CheckpointDamaged, match=r"^--resume-step 5: no such checkpoint in .*; saved steps are 1, 2$"):
        latest_verified_step(copy, explicit=5)
    for step in (1, 2):
        shutil.rmtree(copy / str(step) / "meta")
    with pytest.raises(CheckpointDamaged, match=r"no checkpoint in .* reads completely \(step 2 .*, and 1 older"):
        latest_verified_step(copy)
    with pytest.raises(CheckpointDamaged, match="no other step reads completely either"):
        latest_verified_step(copy, explicit=2)
    assert latest_verified_step(tmp_path / "none") == ResumeChoice(None)


def test_expected_chunks_of_zarr_v2_and_v3_headers():
    v2 = {"zarr_format": 2, "shape": [5, 4], "chunks": [2, 4], "dimension_separator": "."}
    assert _expected_chunks(v2) == {"0.0", "1.0", "2.0"}
    assert _expected_chunks({"zarr_format": 2, "shape": [], "chunks": []}) == {"0"}
    v3 = {
        "zarr_format": 3,
        "shape": [4, 4],
        "chunk_grid": {"configuration": {"chunk_shape": [2, 4]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
    }
    assert _expected_chunks(v3) == {"c/0/0", "c/1/0"}
    assert _expected_chunks({"zarr_format": 9}) is None


def test_inspect_marks_damaged_steps_and_never_tracebacks(copy, capsys):
    data_file_of(copy / "2" / "state", "w").unlink()
    leftover = copy / "3.orbax-checkpoint-tmp-1"  # a save in progress: inspect must not remove it
    leftover.mkdir()
    assert inspect_cli.main([str(copy)]) == 1  # a damaged step: a script's check fails
    out = capsys.readouterr().out
    assert f"checkpoints in {copy}: steps 1, 2 (damaged)" in out
    assert "step 2 in" in out and "is missing (chunks of array" in out and "'w'" in out
    assert "\nstep 1:\n" in out and "total 32,772 bytes in 3 arrays" in out
    assert leftover.is_dir()

    assert inspect_cli.main([str(copy), "--step", "2"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and err.startswith("error: step 2 in")
        and err.rstrip().endswith("--step 1 reads completely")
    )

    truncate(copy / "1" / "meta" / "metadata", 5)
    assert inspect_cli.main([str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no step in") and "Traceback" not in err


def test_inspect_turns_an_unexpected_failure_into_one_error_line(copy, capsys):
    (copy / "2" / "meta" / "metadata").write_text(json.dumps({"mesh": "not a mapping"}))
    assert inspect_cli.main([str(copy)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


CONFIG = ModelConfig(vocab_size=256, num_layers=1, embed_dim=8, mlp_dim=16, num_heads=2, num_kv_heads=2, head_dim=4)
TOKENIZER = types.SimpleNamespace(name="t", fingerprint="f", vocab_size=256)  # the saved meta names none


def save_steps(folder, steps, keep=3):
    manager = CheckpointManager(folder, keep=keep, async_save=False)
    try:
        for step in steps:
            manager.save(
                step, tiny_state(make_mesh(parse_mesh("fsdp=8", 8))), {"step": step, "model": CONFIG.to_dict()}
            )
    finally:
        manager.close()


def resume_and_save(folder, steps, keep=3):
    """`open_resumable` as the training CLI calls it, then saves ``steps``; returns (resumed step, log lines)."""
    lines = []
    manager, step = open_resumable(folder, keep, None, CONFIG, TOKENIZER, as_printed(lines))
    try:
        for new in steps:
            manager.save(new, tiny_state(make_mesh(parse_mesh("fsdp=8", 8))), {"step": new, "model": CONFIG.to_dict()})
    finally:
        manager.close()
    return step, lines


def test_a_damaged_step_is_set_aside_on_resume_and_retention_keeps_the_good_ones(tmp_path):
    """The user's report: steps 6, 8, 10 with --keep 3, step 10's data file cut short, resumed twice.
    Retention used to keep 10 (damaged), 11, 12 and delete the good step 8."""
    folder = tmp_path / "checkpoints"
    save_steps(folder, (6, 8, 10))
    damaged_file = data_file_of(folder / "10" / "state", "w")
    truncate(damaged_file, 100)
    step, lines = resume_and_save(folder, (11,))
    assert step == 8
    assert lines[0].startswith("skipped step 10 in") and lines[0].endswith("resuming from step 8")
    (aside,) = [p for p in folder.iterdir() if p.name.startswith("10.damaged-")]
    assert (
        lines[1]
        == (
            f"set damaged step 10 aside as {aside} (not resumed from, not counted by --keep; "
            "delete it once it is no longer needed)"
        )
        and len(lines) == 2
    )
    # its files are untouched (nothing already saved is lost), the damaged file included
    assert (aside / damaged_file.relative_to(folder / "10")).stat().st_size == 100
    assert saved_steps(folder) == [6, 8, 11]

    step, lines = resume_and_save(folder, (12,))
    assert step == 11 and lines == []
    assert saved_steps(folder) == [8, 11, 12]  # --keep 3 counts the good steps only: 8 stays
    assert aside.is_dir() and verify_step(folder, 8).ok
    manager = CheckpointManager(folder, async_save=False)
    try:
        state, _ = manager.restore(abstract(make_mesh(parse_mesh("fsdp=8", 8))), step=8)
    finally:
        manager.close()
    np.testing.assert_array_equal(np.asarray(state["w"]), W)


def test_an_older_damaged_step_is_set_aside_with_its_reason_and_good_steps_stay(tmp_path):
    folder = tmp_path / "checkpoints"
    save_steps(folder, (6, 8, 10))
    shutil.rmtree(folder / "6" / "meta")
    step, lines = resume_and_save(folder, (11,))
    assert step == 10 and len(lines) == 1
    assert (
        lines[0].startswith("step 6 in") and "the meta item" in lines[0] and "set damaged step 6 aside as" in lines[0]
    )
    assert saved_steps(folder) == [8, 10, 11]
    assert [p.name.split("-")[0] for p in folder.iterdir() if "damaged" in p.name] == ["6.damaged"]


def test_inspect_accepts_a_relative_run_folder(copy, capsys, monkeypatch):
    """README's `python -m checkpoints.inspect runs/a`: Orbax refuses relative paths, so inspect resolves them."""
    monkeypatch.chdir(copy.parent.parent)
    relative = copy.parent.name  # the run folder holding checkpoints/
    assert inspect_cli.main([relative]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    assert f"checkpoints in {copy}: steps 1, 2" in out and "total 32,772 bytes in 3 arrays" in out
    assert inspect_cli.main([os.path.join(relative, "checkpoints"), "--step", "1"]) == 0
    assert "\nstep 1:\n" in capsys.readouterr().out


def test_inspect_names_a_file_a_file_with_the_run_it_is_in(copy, capsys):
    """A file of a checkpoint given for its run was refused as "no such folder", though it exists."""
    meta = copy / "1" / "meta" / "metadata"
    assert inspect_cli.main([str(meta)]) == 2
    err = capsys.readouterr().err.strip()
    assert (
        err
        == f"error: {meta}: a file, not a folder; give a run folder (with checkpoints/), e.g. the run it is in, {copy.parent}"
    )
    assert inspect_cli.main([err.rsplit(", ", 1)[1]]) == 0


# Damaged array contents: what the index walk cannot see, the deep read and the restore do ----------


def flip_bytes(path: Path, count: int = 32, start: int = 0) -> None:
    """Inverts ``count`` bytes of ``path`` from ``start`` (at 0: the zstd frame header of the chunk stored first)."""
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def random_bytes(path: Path) -> None:
    path.write_bytes(np.random.default_rng(0).integers(128, 256, 300, dtype=np.uint8).tobytes())


def test_flipped_bytes_in_a_data_file_pass_the_index_walk_and_fail_the_deep_read(copy):
    damaged = data_file_of(copy / "2" / "state", "w")
    flip_bytes(damaged)
    assert verify_step(copy, 2).ok  # sizes and index intact: only reading the data tells
    verdict = verify_step(copy, 2, deep=True)
    (problem,) = verdict.problems
    assert f"in data file {damaged} does not decode (ZSTD_decompressStream() failed" in problem, problem
    assert problem.startswith("array '") and " chunk " in problem
    assert verify_step(copy, 1, deep=True).ok


def test_a_restore_that_fails_on_damaged_data_sets_the_step_aside_and_restores_the_older_one(copy):
    damaged = data_file_of(copy / "2" / "state", "w")
    flip_bytes(damaged)
    lines, reloads = [], []
    manager = CheckpointManager(copy, async_save=False)
    target = abstract(make_mesh(parse_mesh("fsdp=8", 8)))
    try:
        with pytest.raises(Exception, match="error while reading array"):  # Orbax's own failure, without the fallback
            manager.restore(target, step=2)
        (state, _), step = restore_falling_back(
            copy,
            2,
            lambda s: manager.restore(target, step=s),
            as_printed(lines),
            reload=lambda: reloads.append(manager.reload()),
        )
    finally:
        manager.close()
    assert step == 1 and len(reloads) == 1
    np.testing.assert_array_equal(np.asarray(state["w"]), W)
    (aside,) = [p for p in copy.iterdir() if p.name.startswith("2.damaged-")]
    (line,) = lines
    assert (
        line.startswith(f"step 2 in {copy} is damaged: array '") and f"in data file {damaged} does not decode" in line
    )
    assert line.endswith(f"set it aside as {aside} (not resumed from, not counted by --keep); resuming from step 1")
    assert saved_steps(copy) == [1]
    assert (aside / damaged.relative_to(copy / "2")).read_bytes() != b""  # nothing deleted


def test_processes_fall_back_together_when_the_damage_shows_in_one_only(copy):
    """Two processes (threads here, with a barrier for ``sync`` and a shared vote for ``any_failed``): only
    process 1's restore of step 2 fails (it alone reads the damaged slice). Both read the step before it is
    renamed, process 0 alone renames it, both log the same line and resume step 1."""
    import threading

    damaged = data_file_of(copy / "2" / "state", "w")
    flip_bytes(damaged)
    barrier, votes, results = threading.Barrier(2, timeout=60), [False, False], {}

    def sync(name):
        barrier.wait()

    def process(index):
        def restore(step):
            if step == 2 and index == 1:
                raise ValueError("error while reading array 'w'")
            return f"step {step} on process {index}"

        def any_failed(failed):
            votes[index] = failed
            barrier.wait()
            agreed = any(votes)
            barrier.wait()  # every process has read the votes before the next round writes them
            return agreed

        lines = []
        results[index] = (
            restore_falling_back(
                copy, 2, restore, as_printed(lines), any_failed=any_failed, sync=sync, leader=index == 0
            ),
            lines,
        )

    threads = [threading.Thread(target=process, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    (aside,) = [p for p in copy.iterdir() if p.name.startswith("2.damaged-")]
    assert results[0][0] == ("step 1 on process 0", 1) and results[1][0] == ("step 1 on process 1", 1)
    (line,) = results[0][1]
    assert results[1][1] == [line] and f"in data file {damaged} does not decode" in line
    assert line.endswith(f"set it aside as {aside} (not resumed from, not counted by --keep); resuming from step 1")
    assert saved_steps(copy) == [1]


def test_an_explicit_damaged_step_is_refused_and_a_failure_that_is_not_damage_is_raised(copy):
    flip_bytes(data_file_of(copy / "2" / "state", "w"))
    manager = CheckpointManager(copy, async_save=False)
    target = abstract(make_mesh(parse_mesh("fsdp=8", 8)))
    try:
        with raises_as_cli(
            CheckpointDamaged, match=r"^--resume-step 2: step 2 in .* does not decode .*; pass --resume-step 1$"
        ):
            restore_falling_back(copy, 2, lambda s: manager.restore(target, step=s), print, explicit=True)
        assert saved_steps(copy) == [1, 2]  # an explicit step is refused, never moved

        def out_of_memory(step):
            raise MemoryError("no room")

        with pytest.raises(MemoryError):  # step 1 reads completely: its restore's own error, nothing moved
            restore_falling_back(copy, 1, out_of_memory, print)
    finally:
        manager.close()
    assert saved_steps(copy) == [1, 2]


def test_random_bytes_in_the_array_records_are_named_and_the_older_step_resumed(tmp_path):
    """The user's report: random bytes in state/array_metadatas/process_0 ended a resume in a UTF-8
    error naming no file; now the check names it and the run resumes from the older step."""
    folder = tmp_path / "checkpoints"
    save_steps(folder, (6, 8))
    record = folder / "8" / "state" / "array_metadatas" / "process_0"
    assert record.is_file()
    random_bytes(record)
    verdict = verify_step(folder, 8)
    assert verdict.problems == (
        f"{record} is not valid JSON (not UTF-8 text: byte 0 is 0x{record.read_bytes()[0]:02x})",
    )
    step, lines = resume_and_save(folder, (9,))
    assert step == 6 and lines[0].startswith("skipped step 8 in") and str(record) in lines[0]
    assert any(p.name.startswith("8.damaged-") for p in folder.iterdir())


def test_inspect_deep_reports_damaged_data_that_the_plain_listing_cannot_see(copy, capsys):
    damaged = data_file_of(copy / "2" / "state", "w")
    flip_bytes(damaged)
    assert inspect_cli.main([str(copy)]) == 0
    out = capsys.readouterr().out
    assert f"checkpoints in {copy}: steps 1, 2; array data not read (--deep reads it)" in out
    assert inspect_cli.main([str(copy), "--deep"]) == 1  # the report is printed, the exit status says damage
    out = capsys.readouterr().out
    assert f"checkpoints in {copy}: steps 1, 2 (damaged); every array read" in out
    assert f"in data file {damaged} does not decode" in out and "\nstep 1:\n" in out
    random_bytes(copy / "1" / "state" / "array_metadatas" / "process_0")
    assert inspect_cli.main([str(copy), "--deep"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: no step in") and "Traceback" not in err
    assert inspect_cli.main([str(copy), "--deep", "--step", "1"]) == 2
    assert "array_metadatas/process_0 is not valid JSON" in capsys.readouterr().err


def test_reads_abandoned_by_a_failed_restore_print_no_traceback(monkeypatch):
    """After a restore fails on damaged data, Orbax's pending read coroutines fail again when collected; Python
    would print a traceback for each ("Exception ignored in <coroutine>"). Those are dropped; any other
    unraisable exception still reaches the hook that was installed."""
    from checkpoints.verify import quiet_abandoned_reads

    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    quiet_abandoned_reads()
    quiet_abandoned_reads()  # installed once: a second call does not wrap the filter again

    def coroutine_from(filename):
        namespace = {}
        exec(compile("async def read():\n    pass\n", filename, "exec"), namespace)
        return namespace["read"]()

    orbax_read = coroutine_from(os.path.join(os.sep, "site-packages", "orbax", "serialization.py"))
    ours = coroutine_from(os.path.join(os.sep, "meshwork", "train", "loop.py"))
    for obj in (orbax_read, ours):
        sys.unraisablehook(types.SimpleNamespace(object=obj, exc_type=RuntimeError, exc_value=RuntimeError()))
        obj.close()
    assert [u.object for u in seen] == [ours]
