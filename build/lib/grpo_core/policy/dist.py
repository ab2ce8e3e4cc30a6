"""Process-group setup and the few collectives the trainer needs (the only distributed module
besides the trainer). Works unchanged as a single process: every helper is a no-op there.

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m grpo_core.train --config stage.json
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta

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


class CollectiveTimeoutError(RuntimeError):
    """A rank waited longer than the process group's timeout for the others in one collective."""


def init(timeout_s: float | None = None) -> DistInfo:
    """Join the torchrun process group (nccl on GPU, gloo on CPU), or run as one process.

    ``timeout_s`` bounds how long a rank waits for the others in any one collective (None:
    torch's default, 30 min on gloo and 10 min on nccl). On gloo the waiting rank raises a
    RuntimeError (see :func:`as_timeout_error`); on nccl the watchdog aborts the process."""
    if "RANK" not in os.environ or dist.is_initialized():
        rank, world, local = (dist.get_rank(), dist.get_world_size(), 0) if dist.is_initialized() else (0, 1, 0)
        device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
        return DistInfo(rank, world, local, device)
    local = int(os.environ.get("LOCAL_RANK", 0))
    timeout = {"timeout": timedelta(seconds=timeout_s)} if timeout_s else {}
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", **timeout)
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo", **timeout)
        device = torch.device("cpu")
    return DistInfo(dist.get_rank(), dist.get_world_size(), local, device)


def as_timeout_error(exc: BaseException, timeout_s: float, field: str) -> CollectiveTimeoutError | None:
    """``exc`` restated as a CollectiveTimeoutError that says what happened and what to change,
    or None when it is not a collective timeout. gloo reports one as a bare RuntimeError
    ("Timed out waiting 5000ms for recv operation to complete"), which names neither."""
    text = str(exc)
    if not (isinstance(exc, RuntimeError) and "Timed out waiting" in text):
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveTimeoutError(
        f"rank {rank} waited more than {timeout_s:g} s ({field}) for another rank in a collective. "
        "Another rank is stuck or slower than that: its log shows where. If it legitimately needs "
        f"longer (rank 0 uploading or downloading a large checkpoint), raise {field}")


def cleanup(finished: bool = True) -> None:
    """Leave the process group. After a normal finish every rank first waits for the others
    (rank 0 may still be saving while rank 1 is done). After an error there is no barrier: the
    other ranks may be gone."""
    if dist.is_initialized():
        if finished:
            dist.barrier()
        dist.destroy_process_group()


def end_worker_process() -> None:
    """Under torchrun, end this worker now with exit status 0, skipping the interpreter's teardown;
    alone, return. Call it last, after :func:`cleanup` and after everything is saved and closed.

    Why: a gloo worker thread may still hold the last reference to a finished collective (the
    final barrier) when the main thread starts finalizing the interpreter. Dropping it needs the
    GIL; a finalizing interpreter ends such a thread instead, and the forced unwind through a
    noexcept C++ destructor calls std::terminate: "terminate called without an active
    exception", SIGABRT, exit -6, and torchrun fails a stage whose work was all done and saved
    (gdb: ``pt_gloo_runloop`` in ``~AsyncBarrierWork -> ~ThreadLocalState -> decref ->
    take_gil -> PyThread_exit_thread`` while the main thread is in ``Py_FinalizeEx``). Seen in
    CI; reproduced in 3 of 110 two-rank runs of tests/ddp_update_check.py on 2 cores kept busy
    by 3 spinning processes; none in 150 such runs with this exit.
    Nothing is lost by skipping teardown: checkpoints are written atomically and closed, the
    tracker is flushed and closed, and stdout/stderr are flushed here."""
    if "RANK" not in os.environ or "LOCAL_RANK" not in os.environ:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def active() -> bool:
    return dist.is_initialized() and dist.get_world_size() > 1


def collective_device(device=None) -> torch.device:
    """``device``, else where this process group's collectives run: nccl reduces CUDA tensors
    only (a CPU tensor fails with "No backend type associated with device type cpu"), gloo CPU."""
    if device is not None:
        return torch.device(device)
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: list[float], device=None) -> list[float]:
    """Sum a list of floats over ranks (one collective for the whole list)."""
    if not active():
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_named(values: dict[str, float], device=None) -> dict[str, float]:
    """Sum named floats over ranks in one collective. Every rank passes the same keys in the same
    order (a rank with nothing to add passes 0 for a key, never omits it)."""
    return dict(zip(values, all_reduce_sum(list(values.values()), device)))


def all_reduce_max(value: float, device=None) -> float:
    if not active():
        return value
    t = torch.tensor([value], dtype=torch.float64, device=collective_device(device))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def broadcast_str(value: str) -> str:
    """Rank 0's ``value`` on every rank (itself when no process group is active)."""
    if not active():
        return value
    box = [value]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if active():
        dist.barrier()


def print0(*args, **kwargs) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)
