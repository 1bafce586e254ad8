"""Where a launcher stands among the job's hosts, read from SLURM's, torchrun's or a JobSet's environment."""

import pytest

from train.launcher.command import DEFAULT_LAUNCH_PORT, parse
from train.launcher.hosts import HostPlacement, child_env, expand_hostlist, placement


def test_slurm_host_lists_expand_in_order_with_their_padding():
    assert expand_hostlist("node[01-03,7],login1") == ["node01", "node02", "node03", "node7", "login1"]
    assert expand_hostlist("a[1-2]b[08-09]") == ["a1b08", "a1b09", "a2b08", "a2b09"]
    assert expand_hostlist("gpu-a100-1,gpu-h100-[10-11]") == ["gpu-a100-1", "gpu-h100-10", "gpu-h100-11"]
    assert expand_hostlist("10.0.0.1,10.0.0.2") == ["10.0.0.1", "10.0.0.2"]
    for bad, message in (
        ("node[1-3", "unbalanced"),
        ("node]1", "unbalanced"),
        ("n[3-1]", "backwards"),
        ("n[a]", "a number"),
    ):
        with pytest.raises(ValueError, match=message):
            expand_hostlist(bad)


def test_slurm_torchrun_and_jobset_environments_say_host_0_and_this_host():
    slurm = {"SLURM_JOB_NODELIST": "gpu[07-09]", "SLURM_NODEID": "2", "SLURM_NNODES": "3"}
    assert placement(slurm) == HostPlacement("gpu07", 2, 3, None, "SLURM")
    # a step on part of the allocation: the step's node list
    assert placement({**slurm, "SLURM_STEP_NODELIST": "gpu[08-09]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}) == (
        HostPlacement("gpu08", 1, 2, None, "SLURM")
    )
    torchrun = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "NNODES": "4", "NODE_RANK": "1"}
    assert placement(torchrun) == HostPlacement("10.1.2.3", 1, 4, 29500, "torchrun")
    pytorchjob = {"MASTER_ADDR": "job-master-0", "MASTER_PORT": "23456", "WORLD_SIZE": "2", "RANK": "0"}
    assert placement(pytorchjob) == HostPlacement("job-master-0", 0, 2, 23456, "torchrun")
    jobset = {"JOBSET_NAME": "lm", "REPLICATED_JOB_NAME": "workers", "JOB_INDEX": "0", "JOB_COMPLETION_INDEX": "3"}
    assert placement(jobset, nodes=4) == HostPlacement("lm-workers-0-0.lm", 3, 4, None, "JobSet")
    assert placement({}) is None and placement({"HOME": "/root"}, nodes=1) is None


def test_inconsistent_environments_name_the_variable_and_a_fix():
    for env, nodes, message in (
        (
            {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NODEID": "2", "SLURM_NNODES": "2"},
            None,
            r"host index 2 is outside 0..1",
        ),
        (
            {"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "two"},
            None,
            r"^SLURM_NNODES='two': expected a whole number",
        ),
        ({"SLURM_JOB_NODELIST": "n[1-2]", "SLURM_NNODES": "2"}, 3, r"^--nodes 3: the SLURM environment says 2 hosts"),
        ({"MASTER_ADDR": "h0"}, None, r"^MASTER_ADDR is set but not NODE_RANK/NNODES"),
        ({"JOBSET_NAME": "lm", "JOB_COMPLETION_INDEX": "0"}, None, r"^--nodes: a JobSet does not say"),
        ({}, 2, r"^--nodes 2: no SLURM, torchrun \(MASTER_ADDR\) or JobSet environment"),
    ):
        with pytest.raises(ValueError, match=message):
            placement(env, nodes)
    # the suggestion works: with the variables it names, the same --nodes is accepted
    assert placement({"MASTER_ADDR": "h0", "NNODES": "2", "NODE_RANK": "0"}, 2).count == 2


def test_the_launcher_reads_the_hosts_and_keeps_them_from_the_training_processes(corpus):
    base = ["--local-processes", "2", "--model", "test", "--data", str(corpus)]
    env = {"SLURM_JOB_NODELIST": "n[1-3]", "SLURM_NODEID": "1", "SLURM_NNODES": "3"}
    launch, _, _ = parse([*base, "--min-processes", "6"], env)
    assert (launch.placement.index, launch.hosts, launch.total_processes, launch.launch_port) == (1, 3, 6, 29431)
    assert launch.launch_port == DEFAULT_LAUNCH_PORT
    launch, _, _ = parse(base, {"MASTER_ADDR": "h0", "MASTER_PORT": "1234", "NNODES": "2", "NODE_RANK": "0"})
    assert launch.launch_port == 1234
    launch, _, _ = parse([*base, "--launch-port", "999"], env)
    assert launch.launch_port == 999
    for flags, message in (
        (["--min-processes", "7"], r"^--min-processes 7: must be in 1..6"),
        (["--nodes", "0"], r"^--nodes 0: must be at least 1, e.g. --nodes 2"),
        (["--launch-port", "70000"], r"^--launch-port 70000: must be in 1..65535, e.g. --launch-port 29431"),
    ):
        with pytest.raises(ValueError, match=message):
            parse([*base, *flags], env)
    assert parse([*base, "--nodes", "3"], env)[0].hosts == 3  # the suggested values are accepted
    one = {"SLURM_JOB_NODELIST": "n1", "SLURM_NODEID": "0", "SLURM_NNODES": "1"}
    assert parse(base, one)[0].placement is None  # one node: the launcher runs as on this machine
    assert child_env({**env, "MASTER_ADDR": "h0", "PATH": "/bin"}) == {"PATH": "/bin"}
