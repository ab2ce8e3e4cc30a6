"""The trainer's parts that need no model: the named metric reductions and the promotion gate.
(The checkpointer and the recorder run inside the trainer tests, resume and DDP included.)"""

import math

import pytest
import torch

from grpo_core.rollout.batch import RolloutBatch
from grpo_core.train.gate import PromotionGate
from grpo_core.train.iteration_metrics import TOKEN_MEANS, iteration_metrics, local_sums


def _batch(rewards, lengths, truncated, parts):
    """A batch of G = 2 with the given rewards, completion lengths (of T = 4) and reward parts."""
    B = len(rewards)
    mask = torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]
    return RolloutBatch(prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1),
                        completion_ids=torch.zeros(B, 4, dtype=torch.long), completion_mask=mask,
                        truncated=torch.tensor(truncated), group_size=2, prompts=["p"] * B, completions=["c"] * B,
                        rewards=torch.tensor(rewards), reward_parts=torch.tensor(parts, dtype=torch.float64))


def _upd(tokens, loss, **means):
    return {"num_tokens": float(tokens), "loss": loss, **{k: means.get(k, 0.0) for k in TOKEN_MEANS}}


def _add(a: dict, b: dict) -> dict:  # what all_reduce_named does over two ranks
    assert list(a) == list(b)  # every rank sends the same keys in the same order
    return {k: a[k] + b[k] for k in a}


def test_two_ranks_metrics_are_the_whole_batch_metrics_hand_computed():
    # rank 0: one informative group (1, 0), 3 loss tokens with kl 0.3; rank 1: an all-equal group
    # (1, 1), 1 loss token with kl 0.7. The function "a" applies to 3 rows, "b" to one.
    r0 = _batch([1.0, 0.0], [3, 4], [False, True], [[1.0, float("nan")], [0.0, float("nan")]])
    r1 = _batch([1.0, 1.0], [2, 1], [False, False], [[1.0, 0.5], [float("nan"), float("nan")]])
    sums = _add(local_sums(r0, {"informative_groups": 1, "drawn_groups": 1}, _upd(3, 0.2, kl=0.3), ["m:a", "m:b"]),
                local_sums(r1, {"informative_groups": 0, "drawn_groups": 1}, _upd(1, 0.6, kl=0.7), ["m:a", "m:b"]))
    m = iteration_metrics(5, sums, seconds=2.0, world_size=2, lr=1e-5, grad_norm=0.5, skipped_updates=0,
                          timings={"time_update": 1.23456})
    assert m["iteration"] == 5 and m["reward"] == pytest.approx(0.75)
    assert m["reward_std"] == pytest.approx(math.sqrt(0.75 - 0.75 ** 2))  # population std over 4 rows
    assert m["informative_frac"] == 0.5 and m["completion_len"] == pytest.approx(10 / 4)
    assert m["truncated_frac"] == 0.25 and m["tokens_per_s"] == pytest.approx(10 / 2.0)
    assert m["kl"] == pytest.approx((0.3 * 3 + 0.7 * 1) / 4)  # a token mean, not the mean of rank means
    assert m["loss"] == pytest.approx(0.4)  # DDP's: mean of the ranks' losses
    assert m["reward/a"] == pytest.approx(2 / 3) and m["reward/b"] == 0.5
    assert m["time_update"] == 1.2346 and m["lr"] == 1e-5 and m["grad_norm"] == 0.5
    assert "informative_frac_kept" not in m


def test_a_reward_function_that_applied_nowhere_has_no_mean_and_dynamic_metrics_appear():
    b = _batch([1.0, 0.0], [1, 1], [False, False], [[float("nan")], [float("nan")]])
    m = iteration_metrics(1, local_sums(b, {"informative_groups": 1, "drawn_groups": 3}, _upd(0, 0.0), ["x"]),
                          seconds=1.0, world_size=1, lr=0.0, grad_norm=0.0, skipped_updates=2, timings={},
                          dynamic={"dynamic_rounds": 2, "dynamic_drawn": 3})
    assert "reward/x" not in m and m["kl"] == 0.0 and m["skipped_updates"] == 2
    assert m["informative_frac"] == pytest.approx(1 / 3) and m["informative_frac_kept"] == 1.0
    assert m["dynamic_rounds"] == 2 and m["dynamic_drawn"] == 3


def test_gate_fires_after_patience_consecutive_hits_and_its_state_round_trips():
    gate = PromotionGate("eval_accuracy", 0.9, patience=2)
    assert not gate.observe({"reward": 1.0})  # not measured: neither counts nor resets
    assert not gate.observe({"eval_accuracy": 0.95})
    assert not gate.observe({"reward": 0.1})
    assert gate.hits == 1
    assert gate.observe({"eval_accuracy": 0.91}) and gate.fired
    resumed = PromotionGate("eval_accuracy", 0.9, patience=2)
    resumed.load_state_dict(gate.state_dict())
    assert resumed.fired  # a stage resumed from the checkpoint written when it fired does not train on
    gate.hits = 1
    assert not gate.observe({"eval_accuracy": 0.5}) and gate.hits == 0


def test_no_gate_never_fires():
    gate = PromotionGate(None, 0.0, patience=1)
    assert not gate.observe({"reward": 1.0}) and not gate.fired
