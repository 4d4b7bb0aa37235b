"""No silent fallback: ``run.device: cuda`` without CUDA is an error, the GPU
index follows how the launcher handed out GPUs (one GPU per task: ``cuda:0``, not
``cuda:LOCAL_RANK``), and intra-op threads come from the process's affinity mask shared with the
ranks whose masks overlap it -- not from the machine's CPU count."""

from __future__ import annotations

import pytest
import torch

from cluster_fl.distributed import spawn
from cluster_fl.distributed.launch import cpu_mask, device_index, threads_per_rank
from cluster_fl.errors import UserError


@pytest.mark.parametrize("local_rank, local_world, visible, index", [
    (0, 4, 4, 0), (3, 4, 4, 3), (1, 2, 8, 1),   # every task sees the node's GPUs
    (0, 4, 1, 0), (3, 4, 1, 0),                 # one GPU of its own per task, or 4 ranks on 1
    (1, 4, 2, 0), (2, 4, 2, 1), (3, 4, 2, 1),   # two ranks a GPU, packed evenly
])
def test_the_device_index_follows_the_launchers_gpu_layout(local_rank, local_world, visible,
                                                           index):
    assert device_index(local_rank, local_world, visible) == index


def test_no_visible_device_is_an_error_not_a_guess():
    with pytest.raises(ValueError):
        device_index(0, 1, 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_asked_for_without_cuda_is_an_error_naming_the_key(monkeypatch):
    from cluster_fl.distributed.parallelize import resolve_device

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    with pytest.raises(UserError, match=r"run.device: cuda .*CUDA_VISIBLE_DEVICES=''.*gpus_per_task"):
        resolve_device("cuda", 1, 2)
    assert resolve_device("auto", 1, 2).type == "cpu"
    assert resolve_device("cpu").type == "cpu"


def test_threads_share_the_affinity_mask_with_the_ranks_that_overlap_it():
    assert threads_per_rank({0, 1, 2, 3}, [{0, 1, 2, 3}] * 2) == 2      # torchrun, unbound
    assert threads_per_rank({0, 1}, [{0, 1}, {2, 3}]) == 2              # srun binds each task
    assert threads_per_rank({0, 1, 2, 3, 4, 5, 6, 7}, [set(range(8))] * 4) == 2
    assert threads_per_rank({5}, [{5}, {5}, {5}]) == 1                  # never 0


def test_set_threads_reads_the_mask_not_the_cpu_count(monkeypatch):
    from cluster_fl.config import load_config
    from cluster_fl.distributed import LocalComm
    from cluster_fl.distributed import launch
    from cluster_fl.engine import setup

    before = torch.get_num_threads()
    try:
        monkeypatch.setattr(launch, "cpu_mask", lambda: {3})
        monkeypatch.setattr("os.cpu_count", lambda: 64)
        assert setup.set_threads(load_config(None), LocalComm()) == 1
        assert setup.set_threads(load_config(None, ["run.threads=2"]), LocalComm()) == 2
    finally:
        torch.set_num_threads(before)


def _threads(comm):
    """What ``engine.setup.set_threads`` computes, with its gather (lighter imports)."""
    mine = cpu_mask()
    masks = comm.all_gather_object(sorted(mine))
    return threads_per_rank(mine, [set(m) for m in masks]), len(mine)


def test_two_ranks_on_one_mask_take_half_of_it_each():
    out = spawn(_threads, 2, timeout_s=120)
    cpus = out[0][1]
    assert [n for n, _ in out] == [max(1, cpus // 2)] * 2
