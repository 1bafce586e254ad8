"""--config FILE.toml: every flag by name, the command line overriding it, unknown keys refused naming them; the
run record RUN_DIR/config.json; --resume --run-dir R alone reads the model and layout from the record."""

import json

import pytest
from test_faults import args_for

from train import train
from train.setup import cli
from train.setup.parser import build_parser


def write(path, text):
    path.write_text(text)
    return str(path)


def test_the_command_line_overrides_the_file_and_both_spellings_work(tmp_path):
    config = write(
        tmp_path / "run.toml",
        'model = "test"\nseq-len = 64\nbatch_size = 8\nsteps = 5\n'
        'set = ["num_layers=3"]\nno-progress = true\nmesh = "data=2,fsdp=-1"\n',
    )
    run = cli.parse(["--config", config, "--steps", "7", "--set", "embed_dim=64"])
    assert (run.preset, run.data.seq_len, run.data.batch_size, run.loop.steps) == ("test", 64, 8, 7)
    assert run.model.num_layers == 3 and run.model.embed_dim == 64 and run.loop.progress is False
    assert run.parallelism.mesh_shape["data"] == 2
    assert run.record["command"] == ["--config", config, "--steps", "7", "--set", "embed_dim=64"]
    assert run.record["flags"]["steps"] == 7 and "config" not in run.record["flags"]


@pytest.mark.parametrize(
    "text, message",
    [
        ("sequence_length = 64\n", "unknown key 'sequence_length'"),
        ("resume = 1\n", "resume = 1: expected true or false"),
        ("lr = [1, 2]\n", "lr = [1, 2]: expected one value for --lr"),
        (
            "stage-layers = [3, 1]\n",
            'stage-layers = [3, 1]: expected one value for --stage-layers, e.g. stage-layers = "3,1"',
        ),
        ("lr = \n", "not a TOML file"),
        ("seq-len = 64\nseq_len = 128\n", "keys 'seq-len' and 'seq_len' are the same flag --seq-len; keep one"),
        ('config = "other.toml"\n', "key 'config': a config file cannot name another"),
    ],
)
def test_a_bad_file_is_refused_in_one_line_naming_the_key(tmp_path, capsys, text, message):
    config = write(tmp_path / "run.toml", text)
    code = train.main(["--config", config, "--run-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().startswith(f"error: --config {config}: ") and message in err, err
    assert len(err.strip().splitlines()) == 1 and not (tmp_path / "r").exists()


def test_a_list_for_a_comma_separated_flag_suggests_the_string_that_parses(tmp_path):
    config = write(tmp_path / "run.toml", 'stage-layers = "3,1"\nmesh = "stage=2,fsdp=4"\nmicrobatches = 2\n')
    assert cli.parse(["--config", config, "--model", "test"]).parallelism.pipeline.layout.stage_layers == (3, 1)


def test_a_value_in_the_file_is_checked_as_the_flag(tmp_path, capsys):
    config = write(tmp_path / "run.toml", 'rules = "bogus"\n')
    with pytest.raises(SystemExit) as exit_:
        cli.parse(["--config", config])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "argument --rules: invalid choice: 'bogus'" in err and "usage:" not in err


def test_a_resume_from_the_run_folder_alone_reads_model_and_layout(tmp_path, corpus, cache, capsys):
    run_dir = tmp_path / "run"
    first = args_for(
        corpus, cache, "--steps", "2", "--set", "num_layers=3", "--mesh", "data=2,fsdp=-1", "--run-dir", str(run_dir)
    )
    assert train.main(first) == 0
    record = json.loads((run_dir / "config.json").read_text())
    assert record["command"] == first and record["flags"]["set"] == ["num_layers=3"]
    capsys.readouterr()
    assert train.main(["--resume", "--run-dir", str(run_dir), "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "resumed" in out.lower() or "restored" in out.lower(), out
    assert json.loads((run_dir / "config.json").read_text())["flags"]["steps"] == 3
    resumed = cli.parse(["--resume", "--run-dir", str(run_dir)])
    assert resumed.model.num_layers == 3 and resumed.parallelism.mesh_shape["data"] == 2 and resumed.preset == "test"


def test_a_resume_takes_the_model_and_layout_from_the_record_each_group_whole(tmp_path):
    """Every recorded setting is taken unless the command line names it; a command line that names a layout
    flag re-lays the run, so none of the record's layout flags (a stage split that would not fit the new mesh)
    are taken; the model's flags likewise."""
    from train.setup import configfile

    run = tmp_path / "run"
    run.mkdir()
    recorded = {"model": "test", "set": ["num_layers=6"], "mesh": "stage=2,fsdp=4", "stage_layers": "4,2",
                "ckpt_every": 1, "seq_len": 64}  # fmt: skip
    (run / configfile.RECORD).write_text(json.dumps({"command": [], "flags": recorded}))
    parser = build_parser()

    def parsed(*argv):
        return parser.parse_args(configfile.expand(["--resume", "--run-dir", str(run), *argv], parser))

    alone = parsed()
    assert (alone.model, alone.mesh, alone.stage_layers, alone.seq_len) == ("test", "stage=2,fsdp=4", "4,2", 64)
    assert alone.set == ["num_layers=6"] and alone.ckpt_every == 1
    moved = parsed("--mesh", "fsdp=8")
    assert (moved.mesh, moved.stage_layers, moved.model, moved.seq_len) == ("fsdp=8", None, "test", 64)
    restated = parsed("--model", "small")
    assert restated.set in (None, []) and restated.mesh == "stage=2,fsdp=4"


def test_a_resume_of_a_planned_run_takes_the_cluster_it_was_planned_for(tmp_path):
    """A run started with --plan auto --simulate-cluster h100:4,a100:4 resumed from its record with --plan auto
    but without the cluster, and the planner refused the CPU devices it then saw."""
    from train.setup import configfile

    run = tmp_path / "run"
    run.mkdir()
    recorded = {"model": "test", "plan": "auto", "simulate_cluster": "h100:4,a100:4", "mesh": "fsdp=-1"}
    (run / configfile.RECORD).write_text(json.dumps({"command": [], "flags": recorded}))
    parser = build_parser()

    def parsed(*argv):
        return parser.parse_args(configfile.expand(["--resume", "--run-dir", str(run), *argv], parser))

    alone = parsed()
    assert (alone.plan, alone.simulate_cluster) == ("auto", "h100:4,a100:4")
    moved = parsed("--mesh", "fsdp=8")  # a new layout: the record's plan and cluster are not taken either
    assert (moved.plan, moved.simulate_cluster, moved.mesh) == (None, None, "fsdp=8")


def test_a_resume_restores_how_the_run_ran_unless_named_and_the_record_keeps_its_history(tmp_path):
    """A run resumed on 1 device checkpointing every 50 steps, and its config.json lost the original."""
    from train.setup import configfile

    run = tmp_path / "run"
    run.mkdir()
    recorded = {"model": "test", "cpu_devices": 8, "ckpt_every": 5, "log_every": 3, "eval_every": 7, "steps": 20,
                "data_cache": "/c", "no_progress": True, "process_id": 1, "num_processes": 2}  # fmt: skip
    first = {"command": ["--cpu-devices", "8"], "flags": recorded}
    (run / configfile.RECORD).write_text(json.dumps(first))
    parser = build_parser()
    argv = ["--resume", "--run-dir", str(run), "--log-every", "1"]
    args = parser.parse_args(configfile.expand(argv, parser))
    assert (args.cpu_devices, args.ckpt_every, args.eval_every, args.steps) == (8, 5, 7, 20)
    assert (args.data_cache, args.no_progress, args.log_every) == ("/c", True, 1)
    assert (args.process_id, args.num_processes) == (None, None)  # which process this is: never the record's
    configfile.write_record(str(run), configfile.record_of(argv, args))
    record = json.loads((run / configfile.RECORD).read_text())
    assert record["command"] == argv and record["flags"]["log_every"] == 1
    assert record["history"][0] == first  # a record from before histories: its run opens the list
    assert record["history"][1]["command"] == argv and record["history"][1]["changed"]["log_every"] == [3, 1]
    assert "ckpt_every" not in record["history"][1]["changed"]
    args = parser.parse_args(configfile.expand(["--resume", "--run-dir", str(run), "--steps", "30"], parser))
    assert args.log_every == 1  # the next resume continues from the latest settings
    configfile.write_record(str(run), configfile.record_of(["--steps", "30"], args))
    history = json.loads((run / configfile.RECORD).read_text())["history"]
    assert len(history) == 3 and history[2]["changed"]["steps"] == [20, 30]
