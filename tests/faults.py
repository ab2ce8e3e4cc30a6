"""Crashes injected from the test side into an in-process stage (``grpo_core.train.entry.main``).

Product code has no fault-injection hook: these context managers wrap one real method of the
real trainer for the duration of a ``with`` block, so the stage dies at the chosen point and
everything it wrote before stays as a crash would leave it. Crashes of whole processes come
from outside instead: SIGKILL of a torchrun worker (``tests/test_checkpoint_damage.py``) and a worker
that kills itself (``tests/faulty_rewards.py:gsm8k_correctness_killed_on_call``, used by the flow
tests).
"""
from __future__ import annotations

import contextlib


class InjectedFault(RuntimeError):
    """The crash a test asked for (never raised by product code)."""


@contextlib.contextmanager
def crash_after_iteration(n: int):
    """The stage raises InjectedFault as it starts iteration n + 1: iteration n was trained,
    logged and, when due, checkpointed, as in a process lost between two iterations."""
    from grpo_core.train.trainer import Trainer

    real = Trainer.rollout

    def rollout(self, *args, **kwargs):
        if self.state["iteration"] == n:
            raise InjectedFault(f"injected failure after iteration {n}")
        return real(self, *args, **kwargs)

    Trainer.rollout = rollout
    try:
        yield
    finally:
        Trainer.rollout = real


@contextlib.contextmanager
def crash_before_final_model():
    """The stage raises InjectedFault where it would publish its final model: the last
    checkpoint is written, the final model is not (a process lost at the very end)."""
    from grpo_core.train.stage_checkpoints import StageCheckpoints

    real = StageCheckpoints.publish_final

    def publish_final(self, *args, **kwargs):
        raise InjectedFault("injected failure before the final model was saved")

    StageCheckpoints.publish_final = publish_final
    try:
        yield
    finally:
        StageCheckpoints.publish_final = real
