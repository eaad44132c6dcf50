"""Reading the job from the environment the launchers leave: torchrun / ours, Slurm, Open MPI, MPICH; the store's
port; what is missing is said."""
import pytest

from flame_core.distributed import DistributedError, read_env, world_from_env

BASE = {"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29600"}


def test_torchrun_and_our_launcher():
    e = read_env(env={"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", **BASE})
    assert (e.rank, e.world_size, e.local_rank, e.master_addr, e.store_port) == (3, 4, 1, "10.1.2.3", 29600)


def test_torchrun_agent_store_holds_master_port_so_ours_takes_the_next():
    e = read_env(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                      **BASE})
    assert e.store_port == 29601
    e = read_env(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "TORCHELASTIC_USE_AGENT_STORE": "True",
                      "FLAME_STORE_PORT": "31000", **BASE})
    assert e.store_port == 31000


@pytest.mark.parametrize("env,want", [
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, (5, 8, 1, "Slurm")),
    ({"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "0"},
     (2, 4, 0, "Open MPI")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1"}, (1, 2, 1, "MPICH / Intel MPI")),
    ({"PMI_RANK": "1", "PMI_SIZE": "2", "LOCAL_RANK": "1"}, (1, 2, 1, "MPICH / Intel MPI")),
])
def test_slurm_and_mpi(env, want):
    assert world_from_env(env) == want
    e = read_env(env={**env, **BASE})
    assert (e.rank, e.world_size, e.local_rank) == want[:3]


def test_rank_variables_win_over_slurm_and_a_plain_process_has_none():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "SLURM_PROCID": "0", "SLURM_NTASKS": "1"}
    assert world_from_env(env)[:3] == (1, 2, 1)
    assert world_from_env({}) is None
    with pytest.raises(DistributedError, match="RANK and WORLD_SIZE are not set.*flame_core.distributed.run"):
        read_env(env={})


def test_what_is_missing_or_wrong_is_said():
    with pytest.raises(DistributedError, match="MASTER_ADDR is not set.*Slurm"):
        read_env(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "MASTER_PORT": "1"})
    with pytest.raises(DistributedError, match="MASTER_PORT is not set"):
        read_env(env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "a"})
    with pytest.raises(DistributedError, match="not SLURM_LOCALID.*LOCAL_RANK"):
        read_env(env={"SLURM_PROCID": "0", "SLURM_NTASKS": "2", **BASE})
    with pytest.raises(DistributedError, match=r"WORLD_SIZE='two'.*not an integer"):
        read_env(env={"RANK": "0", "WORLD_SIZE": "two", **BASE})
    with pytest.raises(DistributedError, match="do not fit together"):
        read_env(env={"RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", **BASE})
    with pytest.raises(DistributedError, match="not a TCP port"):
        read_env(env={"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"})


def test_explicit_rank_and_world_size_on_one_machine():
    e = read_env(rank=1, world_size=3, env={"MASTER_PORT": "29999"})
    assert (e.rank, e.world_size, e.master_addr, e.store_port) == (1, 3, "localhost", 29999)
