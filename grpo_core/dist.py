"""Process-group setup and the few collectives the trainer needs (the only distributed module
besides the trainer). Works unchanged as a single process: every helper is a no-op there.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m grpo_core.train --config stage.json
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init() -> DistInfo:
    """Join the torchrun process group (nccl on GPU, gloo on CPU), or run as one process."""
    if "RANK" not in os.environ or dist.is_initialized():
        rank, world, local = (dist.get_rank(), dist.get_world_size(), 0) if dist.is_initialized() else (0, 1, 0)
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return DistInfo(rank, world, local, device)
    local = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, device)


def cleanup(finished: bool = True) -> None:
    """Leave the process group. After a normal finish every rank first waits for the others
    (rank 0 may still be saving while rank 1 is done). Without it, a CI run on 2 cores saw rank 1
    abort at exit after its last iteration ("terminate called without an active exception") while
    rank 0 was still finishing. After an error there is no barrier: the other ranks may be gone."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def all_reduce_sum(values: list[float], device=None) -> list[float]:
    """Sum a list of floats over ranks (one collective for the whole list)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(value: float, device=None) -> float:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def barrier() -> None:
    if active():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
