"""Ranks from the launcher: the variables of torchrun, SLURM, Open MPI and TRANSPORTD_*, their precedence and
errors; and examples/launcher_ranks.py run as torchrun runs it (real processes, two daemons)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpuclient
from gpuclient.errors import LauncherError
from gpuclient.launcher import from_environment
from transportd_cli.localcluster import LocalCluster

pytestmark = pytest.mark.multiprocess  # several processes: the unit tests run apart with -m 'not multiprocess'

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "launcher_ranks.py"

TORCHRUN = {"TORCHELASTIC_RUN_ID": "abc123", "RANK": "3", "WORLD_SIZE": "16", "LOCAL_RANK": "3",
            "TORCHELASTIC_RESTART_COUNT": "0"}
SLURM = {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "1", "SLURM_PROCID": "9", "SLURM_NTASKS": "16",
         "SLURM_LOCALID": "1"}
OMPI = {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
        "PMIX_NAMESPACE": "prterun-host1-1234@1"}


def test_each_launcher():
    t = from_environment(TORCHRUN)
    assert (t.job, t.rank, t.world, t.device, t.launcher) == ("torch-abc123-r0", 3, 16, 3, "torchrun")
    s = from_environment(SLURM)
    assert (s.job, s.rank, s.world, s.device, s.launcher) == ("slurm-4242.1", 9, 16, 1, "slurm")
    o = from_environment(OMPI)
    assert (o.job, o.rank, o.world, o.device, o.launcher) == ("ompi-prterun-host1-1234.1", 5, 8, 1, "openmpi")
    legacy = {k: v for k, v in OMPI.items() if k != "PMIX_NAMESPACE"} | {"OMPI_MCA_orte_ess_jobid": "77"}
    assert from_environment(legacy).job == "ompi-77"
    ours = from_environment({"TRANSPORTD_JOB": "train", "TRANSPORTD_RANK": "1", "TRANSPORTD_WORLD": "2"})
    assert (ours.job, ours.rank, ours.world, ours.device) == ("train", 1, 2, None)


def test_precedence_inner_launcher_beats_slurm():
    # torchrun (or mpirun) inside an allocation: SLURM_PROCID numbers the agents, the inner ranks are true
    assert from_environment(SLURM | TORCHRUN).launcher == "torchrun"
    assert from_environment(SLURM | OMPI).launcher == "openmpi"
    assert from_environment(OMPI | TORCHRUN).launcher == "torchrun"
    ours = {"TRANSPORTD_JOB": "mine", "TRANSPORTD_RANK": "0", "TRANSPORTD_WORLD": "1"}
    assert from_environment(SLURM | TORCHRUN | OMPI | ours).job == "mine"


def test_torchrun_default_run_id_and_restarts_give_distinct_names():
    base = TORCHRUN | {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert from_environment(base).job == "torch-none-10.0.0.1-29500-r0"
    assert from_environment(base | {"TORCHELASTIC_RESTART_COUNT": "2"}).job == "torch-none-10.0.0.1-29500-r2"
    long = from_environment(TORCHRUN | {"TORCHELASTIC_RUN_ID": "x" * 200}).job
    assert len(long) == 64


def test_errors_name_the_variables():
    with pytest.raises(LauncherError) as exc:
        from_environment({})
    for name in ("TORCHELASTIC_RUN_ID", "SLURM_PROCID", "SLURM_STEP_ID", "OMPI_COMM_WORLD_RANK",
                 "TRANSPORTD_WORLD"):
        assert name in str(exc.value)
    with pytest.raises(LauncherError, match=r"slurm \(has SLURM_JOB_ID; missing SLURM_STEP_ID"):
        from_environment({"SLURM_JOB_ID": "1"})  # an sbatch shell, not an srun task
    with pytest.raises(LauncherError, match="RANK='x' is not an integer"):
        from_environment(TORCHRUN | {"RANK": "x"})
    with pytest.raises(LauncherError, match="outside the world of 16"):
        from_environment(TORCHRUN | {"RANK": "16"})
    with pytest.raises(LauncherError, match="PMIX_NAMESPACE"):
        from_environment({k: v for k, v in OMPI.items() if k != "PMIX_NAMESPACE"})


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(2) as c:
        yield c


def test_join_takes_the_environment_and_refuses_half(cluster):
    env = {"TRANSPORTD_JOB": "from-env", "TRANSPORTD_RANK": "0", "TRANSPORTD_WORLD": "1",
           "TRANSPORTD_LOCAL_RANK": "0"}
    with gpuclient.connect(cluster.socket("nodea")) as client:
        with pytest.raises(TypeError, match="not rank, world"):
            client.join("half")
        session = client.join(env=env)
        assert (session.job, session.rank, session.world, session.device) == ("from-env", 0, 1, 0)
        session.leave()
        with pytest.raises(LauncherError, match="no launcher found"):
            client.join(env={})


def test_example_runs_as_torchrun_starts_it(cluster):
    """The example's processes with the variables torchrun --standalone --nproc-per-node 2 gives them."""
    sockets = ",".join(cluster.socket(n) for n in cluster.names)
    base = {k: v for k, v in os.environ.items() if k not in ("TRANSPORTD_SOCKET", "RANK", "WORLD_SIZE")}
    procs = []
    for rank in range(2):
        env = base | {"TORCHELASTIC_RUN_ID": "ci-example", "TORCHELASTIC_RESTART_COUNT": "0",
                      "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                      "RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                      "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "GROUP_WORLD_SIZE": "1",
                      "ROLE_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
                      "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(EXAMPLE), "--sockets", sockets, "--bytes", "65536",
                                       "--timeout", "60"], env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for rank, (p, out) in enumerate(zip(procs, outputs, strict=True)):
        assert p.returncode == 0, out
        assert f"rank {rank}/2 (job torch-ci-example-r0, torchrun, local rank {rank}, node node{'ab'[rank]})" in out
        assert out.rstrip().endswith("OK"), out


def test_example_local_cluster_without_torchrun_uses_the_transportd_variables(tmp_path):
    """`--local-cluster 2` where torchrun is not installed: the example starts its ranks itself, with
    TRANSPORTD_JOB/RANK/WORLD/LOCAL_RANK, and every byte arrives."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRANSPORTD_")} | {"PATH": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--local-cluster", "2", "--bytes", "65536", "--timeout", "60"],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "torchrun is not on PATH" in proc.stdout
    for rank in range(2):
        assert re.search(rf"rank {rank}/2 \(job local-\d+, transportd, local rank {rank}, node node{'ab'[rank]}\): "
                         r"65536 bytes from rank \d: OK", proc.stdout), proc.stdout
