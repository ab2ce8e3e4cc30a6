"""A rank that stops answering, under real torchrun: a hung reward function and a rank stuck
outside collectives end the stage with an error naming the setting; only collective timeouts
are restated; collectives run on the device the backend reduces on.
"""
from __future__ import annotations

import time

import torch

from tests.fault_helpers import finish_torchrun, start_torchrun


def test_hung_reward_function_stops_both_ranks_with_an_error_naming_it(tiny, tmp_path):
    """A verifier that never returns would stall every rank forever (the others wait in the next
    collective). Under torchrun, reward_timeout_s ends the stage with an error naming the function,
    before any update or checkpoint."""
    log = tmp_path / "torchrun.log"
    t0 = time.monotonic()
    rc = finish_torchrun(start_torchrun(tiny, tmp_path / "out", log, rewards=[{"fn": "tests.faulty_rewards:hangs"}],
                                        reward_timeout_s=2), log)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert "RewardTimeoutError: reward function 'tests.faulty_rewards:hangs' took more than 2 s" in text
    assert time.monotonic() - t0 < 300
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_rank_stuck_outside_collectives_fails_the_stage_after_collective_timeout_s(tiny, tmp_path):
    """Rank 1 hangs where no reward time limit applies (reward_timeout_s=0); rank 0 waits in the
    next collective for collective_timeout_s, not torch's 30 min (gloo) or 10 min (nccl), then
    fails with an error naming the field, and torchrun stops the stuck rank."""
    log = tmp_path / "torchrun.log"
    rc = finish_torchrun(start_torchrun(tiny, tmp_path / "out", log,
                                        rewards=[{"fn": "tests.faulty_rewards:hangs_on_rank_1"}], reward_timeout_s=0,
                                        execution={"collective_timeout_s": 5}, runtime={"stage": "cur"}), log)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert ("CollectiveTimeoutError: rank 0 waited more than 5 s (stage 'cur'.execution.collective_timeout_s) "
            "for another rank in a collective") in text, text[-3000:]
    assert "raise stage 'cur'.execution.collective_timeout_s" in text
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_only_collective_timeouts_are_restated():
    from grpo_core.policy.dist import as_timeout_error

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 5000ms for recv operation to complete")
    assert "waited more than 5 s (x.collective_timeout_s)" in str(as_timeout_error(gloo, 5, "x.collective_timeout_s"))
    for other in (RuntimeError("CUDA out of memory"), TimeoutError("Timed out waiting for S3"), ValueError("x")):
        assert as_timeout_error(other, 5, "x") is None


def test_collectives_run_where_the_backend_reduces():
    """nccl reduces CUDA tensors only: helpers called without a device (the non-finite check, the
    dynamic-sampling refill vote) must not build a CPU tensor there. Without a process group or
    on gloo that is the CPU; a device passed in wins."""
    from grpo_core.policy.dist import collective_device

    assert collective_device() == torch.device("cpu")
    assert collective_device("meta") == torch.device("meta")
