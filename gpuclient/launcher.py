"""Job, rank and world from the launcher that started this process (torchrun, SLURM, Open MPI, or ours).

``client.join()`` with no job, rank or world calls :func:`from_environment`. The first launcher whose
variables are present wins, in this order:

1. ``TRANSPORTD_JOB``, ``TRANSPORTD_RANK``, ``TRANSPORTD_WORLD`` (optional ``TRANSPORTD_LOCAL_RANK``):
   an explicit choice beats anything a launcher set around it.
2. torchrun / torch.distributed elastic: ``TORCHELASTIC_RUN_ID``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``.
3. Open MPI / PMIx: ``OMPI_COMM_WORLD_RANK``, ``OMPI_COMM_WORLD_SIZE``, ``OMPI_COMM_WORLD_LOCAL_RANK``;
   the job from ``PMIX_NAMESPACE``, else ``OMPI_MCA_orte_ess_jobid``.
4. SLURM: ``SLURM_JOB_ID`` with ``SLURM_STEP_ID``, ``SLURM_PROCID``, ``SLURM_NTASKS``, ``SLURM_LOCALID``.

SLURM comes last because torchrun or mpirun started *inside* an allocation inherit its variables: there
``SLURM_PROCID`` numbers the launchers (one torchrun agent per node), not the workers, and the inner
launcher's variables are the true ranks. The job name is derived from the launcher's job id, so every
rank of one launch computes the same name on every node and two launches never share one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass

from cmd_ring.protocol import MAX_NAME_LEN
from gpuclient.errors import LauncherError

__all__ = ["LaunchInfo", "from_environment", "LAUNCHER_VARIABLES"]


@dataclass(frozen=True)
class LaunchInfo:
    """What the launcher says about this process."""

    job: str
    rank: int
    world: int
    local_rank: int | None  # None: the launcher does not say (TRANSPORTD_* without TRANSPORTD_LOCAL_RANK)
    launcher: str  # transportd | torchrun | openmpi | slurm

    @property
    def device(self) -> int | None:
        """The local GPU index this rank uses by default: its local rank (one GPU per local rank)."""
        return self.local_rank


#: launcher -> the variables it is recognised by (all required) and those read when present.
LAUNCHER_VARIABLES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "transportd": (("TRANSPORTD_JOB", "TRANSPORTD_RANK", "TRANSPORTD_WORLD"), ("TRANSPORTD_LOCAL_RANK",)),
    "torchrun": (("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK"), ("TORCHELASTIC_RESTART_COUNT",
                                                                             "MASTER_ADDR", "MASTER_PORT")),
    "openmpi": (("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
                ("PMIX_NAMESPACE", "OMPI_MCA_orte_ess_jobid")),
    "slurm": (("SLURM_JOB_ID", "SLURM_STEP_ID", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"), ()),
}

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


def _job_name(prefix: str, *parts: str) -> str:
    """A job name the protocol accepts (letters, digits, '.', '_', '-'; at most 64) from launcher ids."""
    name = "-".join([prefix, *(_UNSAFE.sub(".", p).strip(".") for p in parts if p)])
    return name[:MAX_NAME_LEN]


def _int(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    try:
        return int(raw.strip())
    except ValueError:
        raise LauncherError(f"{name}={raw!r} is not an integer") from None


def _checked(info: LaunchInfo, names: tuple[str, str]) -> LaunchInfo:
    if info.world < 1:
        raise LauncherError(f"{names[1]}={info.world}: the world must be at least 1")
    if not 0 <= info.rank < info.world:
        raise LauncherError(f"{names[0]}={info.rank} is outside the world of {info.world} ({names[1]})")
    if info.local_rank is not None and info.local_rank < 0:
        raise LauncherError(f"local rank {info.local_rank} is negative")
    return info


def from_environment(env: Mapping[str, str] | None = None) -> LaunchInfo:
    """Read job, rank, world and local rank from the launcher's variables (see the module docstring)."""
    env = os.environ if env is None else env
    if all(n in env for n in LAUNCHER_VARIABLES["transportd"][0]):
        job = env["TRANSPORTD_JOB"].strip()
        if not job:
            raise LauncherError("TRANSPORTD_JOB is empty")
        local = _int(env, "TRANSPORTD_LOCAL_RANK") if "TRANSPORTD_LOCAL_RANK" in env else None
        return _checked(LaunchInfo(job, _int(env, "TRANSPORTD_RANK"), _int(env, "TRANSPORTD_WORLD"), local,
                                   "transportd"), ("TRANSPORTD_RANK", "TRANSPORTD_WORLD"))
    if all(n in env for n in LAUNCHER_VARIABLES["torchrun"][0]):
        run_id = env["TORCHELASTIC_RUN_ID"]
        # torchrun's default --rdzv-id is "none": then the rendezvous address is what tells launches apart
        where = [env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")] if run_id in ("", "none") else []
        # an elastic restart reuses the run id: a new name, so a late-reclaimed rank of the last round
        # cannot collide with this one
        job = _job_name("torch", run_id, *where, "r" + env.get("TORCHELASTIC_RESTART_COUNT", "0"))
        return _checked(LaunchInfo(job, _int(env, "RANK"), _int(env, "WORLD_SIZE"), _int(env, "LOCAL_RANK"),
                                   "torchrun"), ("RANK", "WORLD_SIZE"))
    if all(n in env for n in LAUNCHER_VARIABLES["openmpi"][0]):
        job_id = env.get("PMIX_NAMESPACE") or env.get("OMPI_MCA_orte_ess_jobid")
        if not job_id:
            raise LauncherError("OMPI_COMM_WORLD_RANK is set but neither PMIX_NAMESPACE nor "
                                "OMPI_MCA_orte_ess_jobid names the job: set TRANSPORTD_JOB")
        return _checked(LaunchInfo(_job_name("ompi", job_id), _int(env, "OMPI_COMM_WORLD_RANK"),
                                   _int(env, "OMPI_COMM_WORLD_SIZE"), _int(env, "OMPI_COMM_WORLD_LOCAL_RANK"),
                                   "openmpi"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"))
    if all(n in env for n in LAUNCHER_VARIABLES["slurm"][0]):
        # each srun step is its own set of ranks: the step id is part of the job name
        job = _job_name("slurm", env["SLURM_JOB_ID"] + "." + env["SLURM_STEP_ID"])
        return _checked(LaunchInfo(job, _int(env, "SLURM_PROCID"), _int(env, "SLURM_NTASKS"),
                                   _int(env, "SLURM_LOCALID"), "slurm"), ("SLURM_PROCID", "SLURM_NTASKS"))
    partial = [f"{launcher} (has {', '.join(n for n in req if n in env)}; missing "
               f"{', '.join(n for n in req if n not in env)})"
               for launcher, (req, _) in LAUNCHER_VARIABLES.items() if any(n in env for n in req)]
    looked = "; ".join(f"{launcher}: {', '.join(req)}" for launcher, (req, _) in LAUNCHER_VARIABLES.items())
    raise LauncherError("no launcher found in the environment to take job, rank and world from. Looked for "
                        f"{looked}." + (f" Partly set: {'; '.join(partial)}." if partial else "")
                        + " Pass job, rank and world to join(), or set TRANSPORTD_JOB, TRANSPORTD_RANK and "
                          "TRANSPORTD_WORLD.")
