"""Where this process sits in the job, read from the environment the launcher left.

FLAME's own launcher (`python -m flame_core.distributed.run`) and torchrun set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR, MASTER_PORT. Slurm's srun sets SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID, Open MPI's mpirun
OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK, MPICH and Intel MPI PMI_RANK / PMI_SIZE (and MPI_LOCALRANKID); those
are used where RANK / WORLD_SIZE / LOCAL_RANK are not set. MASTER_ADDR and MASTER_PORT always come from the
environment (Slurm and MPI do not choose a rendezvous address; see docs/DISTRIBUTED.md for the lines that set
them); on one machine MASTER_ADDR defaults to localhost when the world is a single node's.

Under torchrun the port MASTER_PORT is already held by torchrun's own store (TORCHELASTIC_USE_AGENT_STORE=True),
so FLAME's store takes MASTER_PORT + 1 there; FLAME_STORE_PORT overrides the port in every case.
"""
import os
from dataclasses import dataclass

from ..errors import FlameError


class DistributedError(FlameError, RuntimeError):
    """A distributed job that cannot start or go on (the message says what is missing or which rank failed)."""


_SOURCES = (  # (name of the launcher, rank, world size, local rank)
    ("torchrun / flame_core.distributed.run", "RANK", "WORLD_SIZE", "LOCAL_RANK"),
    ("Slurm", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"),
    ("Open MPI", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK"),
    ("MPICH / Intel MPI", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"),
)


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    store_port: int
    source: str


def _int(env, name, source):
    v = env.get(name)
    try:
        return int(v)
    except (TypeError, ValueError):
        raise DistributedError(f"{name}={v!r} (set by {source}) is not an integer") from None


def world_from_env(env=None):
    """(rank, world_size, local_rank, source) from the first launcher whose variables are set, or None when none
    is (a plain single process)."""
    env = os.environ if env is None else env
    for source, r, w, lr in _SOURCES:
        if env.get(r) is not None and env.get(w) is not None:
            rank, world = _int(env, r, source), _int(env, w, source)
            local = _int(env, lr, source) if env.get(lr) is not None else None
            if local is None and env.get("LOCAL_RANK") is not None:
                local = _int(env, "LOCAL_RANK", source)
            if local is None:
                if world > 1:
                    raise DistributedError(f"{source} set {r} and {w} but not {lr}: which GPU of the machine "
                                           f"this rank uses is unknown; set LOCAL_RANK")
                local = 0
            if world < 1 or not 0 <= rank < world or local < 0:
                raise DistributedError(f"{source}: rank {rank}, world size {world}, local rank {local} do not fit "
                                       f"together (0 <= rank < world size)")
            return rank, world, local, source
    return None


def read_env(rank=None, world_size=None, env=None):
    """The DistEnv of this process (rank / world_size given explicitly win over the environment)."""
    env = os.environ if env is None else env
    found = world_from_env(env)
    if found is None and (rank is None or world_size is None):
        raise DistributedError("no distributed environment: RANK and WORLD_SIZE are not set (nor Slurm's or MPI's "
                               "variables); start the script with `python -m flame_core.distributed.run "
                               "--nproc-per-node N script.py`, torchrun or srun, or pass rank= and world_size=")
    r, w, local, source = found if found is not None else (rank, world_size, 0, "arguments")
    if rank is not None:
        r = int(rank)
    if world_size is not None:
        w = int(world_size)
    if not 0 <= r < w:
        raise DistributedError(f"rank {r} is not in 0..{w - 1} (world size {w})")
    addr = env.get("MASTER_ADDR")
    if not addr:
        if w > 1 and source != "torchrun / flame_core.distributed.run" and source != "arguments":
            raise DistributedError(f"{source} started {w} ranks but MASTER_ADDR is not set: export the address of "
                                   f"the machine of rank 0 (docs/DISTRIBUTED.md shows how under {source})")
        addr = "localhost"
    port_var = "FLAME_STORE_PORT" if env.get("FLAME_STORE_PORT") else "MASTER_PORT"
    if not env.get(port_var):
        raise DistributedError(f"MASTER_PORT is not set ({source} started rank {r} of {w}): export a free TCP port "
                               f"of the machine of rank 0, the same on every rank")
    port = _int(env, port_var, source)
    if port_var == "MASTER_PORT" and env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        port += 1  # torchrun's own store listens on MASTER_PORT
    if not 0 < port < 65536:
        raise DistributedError(f"{port_var}={port} is not a TCP port (1..65535)")
    return DistEnv(r, w, local, addr, port, source)
