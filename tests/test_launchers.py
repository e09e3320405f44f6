"""Which launcher started a process, and the group its ranks form: DeepSpeed's runner drives mpirun (openmpi, mvapich,
mpich) and srun (slurm), which set only their own variables. The real mpirun and pdsh runs are
scripts/launchers_check.sh (they need Debian packages and an sshd); here the variables each launcher sets, read by
`pipeline.dist.launch_env`, and two real processes given only an MPI's or srun's variables joining one gloo group."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, child_env
from pipeline import dist
from pipeline.dist import LaunchEnv, launch_env


@pytest.mark.parametrize("env, expected", [
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_SIZE": "2"}, LaunchEnv("deepspeed", 3, 4, 1, 2)),
    ({"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}, LaunchEnv("deepspeed", 0, 1, 0, 1)),  # --num_gpus 1
    ({"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "4"}, LaunchEnv("openmpi", 5, 8, 1, 4)),
    ({"MV2_COMM_WORLD_RANK": "1", "MV2_COMM_WORLD_SIZE": "2", "MV2_COMM_WORLD_LOCAL_RANK": "1",
      "MV2_COMM_WORLD_LOCAL_SIZE": "2"}, LaunchEnv("mvapich", 1, 2, 1, 2)),
    ({"PMI_RANK": "2", "PMI_SIZE": "4", "MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, LaunchEnv("mpich", 2, 4, 0, 2)),
    # srun: 2 tasks on each of 2 nodes, then 1 on a third; this task is the third node's
    ({"SLURM_PROCID": "4", "SLURM_STEP_NUM_TASKS": "5", "SLURM_LOCALID": "0", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1",
      "SLURM_NODEID": "2", "SLURM_NTASKS": "5"}, LaunchEnv("slurm", 4, 5, 0, 1)),
    # a batch script of an 8-task allocation is one process, not rank 0 of 8
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0", "SLURM_JOB_ID": "7"}, None),
    ({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "0",
      "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}, None),  # mpirun -n 1: alone
    ({}, None),
])
def test_each_launchers_variables_give_this_ranks_place(env, expected):
    assert launch_env(env) == expected


def test_deepspeeds_variables_win_over_the_mpi_that_started_its_launcher():
    """pdsh under an MPI job, or DeepSpeed's own launch.py started by mpirun: the ranks it spawned are its own."""
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "LOCAL_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0",
           "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "1"}
    assert launch_env(env) == LaunchEnv("deepspeed", 1, 2, 1, 2)


def test_incomplete_launcher_variables_are_an_error_naming_them():
    with pytest.raises(RuntimeError, match="started by openmpi but its variables are incomplete.*"
                                           "OMPI_COMM_WORLD_LOCAL_RANK=None"):
        launch_env({"OMPI_COMM_WORLD_RANK": "0", "OMPI_COMM_WORLD_SIZE": "2"})


def test_the_launch_variables_a_child_drops_are_every_launchers(monkeypatch):
    """pipeline.dist.LAUNCH_VARS, which the tests' and the benchmarks' child environments drop (one list)."""
    assert {v for names in dist.LAUNCHER_VARS.values() for v in names} <= set(dist.LAUNCH_VARS)
    for name in dist.LAUNCH_VARS:
        monkeypatch.setenv(name, "1")
    assert not set(dist.LAUNCH_VARS) & set(child_env())


def test_a_relaunch_names_no_hostfile_so_a_clusters_job_hostfile_is_not_used():
    """DeepSpeed's runner reads /job/hostfile unless told otherwise, and would spread `--nproc 2` over its hosts."""
    from deepspeed.launcher import runner

    cmd = dist.launcher_command(2, "cli", ["teacher", "recipes/tiny.yaml"])
    args = runner.parse_args(cmd[3:])
    assert args.hostfile == os.devnull and runner.fetch_hostfile(args.hostfile) is None
    assert args.num_gpus == 2 and args.module and args.user_script == "cli"


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["openmpi", "slurm"])
def test_ranks_given_only_an_mpi_or_srun_environment_form_one_group(launcher):
    """Two real processes with only the variables mpirun (or srun) gives each rank, and MASTER_ADDR exported as
    `mpirun -x` / `srun --export` would: one gloo group of 2 (before, each made a 1-rank group of its own)."""
    port = str(dist.free_port())
    procs = []
    for rank in range(2):
        if launcher == "openmpi":
            env = {"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                   "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
        else:
            env = {"SLURM_PROCID": str(rank), "SLURM_STEP_NUM_TASKS": "2", "SLURM_LOCALID": str(rank),
                   "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_NODEID": "0"}
        procs.append(subprocess.Popen([sys.executable, "-m", "pipeline.dist"], cwd=ROOT, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True,
                                      env=child_env(**env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port)))
    outs = [p.communicate(timeout=180)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(o[-2000:] for o in outs)
    seen = [json.loads(next(line for line in o.splitlines() if line.startswith("{"))) for o in outs]
    assert [(s["launcher"], s["rank"], s["world"], s["local_world"], s["all_reduce"]) for s in seen] == \
        [(launcher, 0, 2, 2, 2.0), (launcher, 1, 2, 2, 2.0)]
