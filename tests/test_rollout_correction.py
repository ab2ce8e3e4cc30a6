"""Rollout/trainer mismatch correction: the importance weights against hand-computed values, the
loss they enter, and the in-process engine left exactly as it was (no weights, no metrics)."""
import math

import pytest
import torch

from grpo_core.algo import losses
from grpo_core.algo.losses import grpo_loss, rollout_is_weights
from grpo_core.config import groups as config
from grpo_core.train.iteration_metrics import add_mismatch, mismatch_metrics, new_mismatch

OLD = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.0, -1.0]])
SAMPLER = torch.tensor([[-1.5, -1.0, -9.0], [-1.0, -1.0, -1.0]])  # -9: off the mask, never read
MASK = torch.tensor([[True, True, False], [True, True, True]])
E = math.exp


@pytest.mark.parametrize("mode, row0", [
    ("token_truncate", [1.5, E(-1.0)]),         # r = e^0.5 = 1.65 capped at 1.5; e^-1 kept
    ("token_mask", [0.0, E(-1.0)]),             # e^0.5 > 1.5: zeroed
    ("sequence_truncate", [E(-0.5), E(-0.5)]),  # the sequence's log-ratio: 0.5 - 1.0
    ("sequence_mask", [E(-0.5), E(-0.5)]),
    ("none", [1.0, 1.0]),
])
def test_importance_weights_are_the_hand_computed_ones(mode, row0):
    w, stats = rollout_is_weights(OLD, SAMPLER, MASK, mode, cap=1.5)
    expected = torch.tensor([row0 + [0.0], [1.0, 1.0, 1.0]])
    assert (w - expected).abs().max() <= 1e-6  # (not torch.testing: metaflow's typing_extensions breaks it)
    assert float(stats["tokens"]) == 5 and float(stats["gap_sum"]) == pytest.approx(1.5)
    assert float(stats["gap_max"]) == pytest.approx(1.0)
    lo, hi = (E(-0.5), 1.0) if mode.startswith("sequence") else (E(-1.0), E(0.5))  # r before the cap
    assert float(stats["ratio_min"]) == pytest.approx(lo) and float(stats["ratio_max"]) == pytest.approx(hi)
    assert float(stats["capped"]) == (1.0 if mode.startswith("token") else 0.0)


def test_a_sequence_above_the_cap_is_masked_whole_or_truncated():
    old, sampler = torch.tensor([[-0.2, -0.2]]), torch.tensor([[-1.0, -1.0]])  # sum 1.6: r = 4.95
    mask = torch.ones(1, 2, dtype=torch.bool)
    assert rollout_is_weights(old, sampler, mask, "sequence_mask", 3.0)[0].tolist() == [[0.0, 0.0]]
    assert rollout_is_weights(old, sampler, mask, "sequence_truncate", 3.0)[0].tolist() == [[3.0, 3.0]]


def test_bad_modes_and_caps_are_refused():
    with pytest.raises(ValueError, match="rollout_is must be one of"):
        rollout_is_weights(OLD, SAMPLER, MASK, "tis")
    with pytest.raises(ValueError, match="rollout_is_cap must be >= 1"):
        rollout_is_weights(OLD, SAMPLER, MASK, "token_mask", cap=0.5)
    assert config.ROLLOUT_IS_MODES == losses.ROLLOUT_IS_MODES  # the config's copy (it imports no torch)


def _loss_and_grad(is_weight):
    logp = torch.tensor([[-1.0, -2.0, -0.5], [-1.0, -1.5, -0.7]], requires_grad=True)
    ref = torch.tensor([[-1.1, -2.1, -0.4], [-0.9, -1.4, -0.6]])
    loss, _ = grpo_loss(logp, logp.detach(), ref, torch.tensor([1.0, -1.0]), MASK, beta=0.04, loss_type="bnpo",
                        is_weight=is_weight)
    loss.backward()
    return loss.detach(), logp.grad


def test_weights_of_one_leave_the_loss_and_its_gradient_bitwise_unchanged():
    loss, grad = _loss_and_grad(None)
    ones, _ = rollout_is_weights(OLD, OLD, MASK, "sequence_mask")  # a sampler that agrees exactly
    assert torch.equal(ones, MASK.float())
    loss1, grad1 = _loss_and_grad(ones)
    assert torch.equal(loss, loss1) and torch.equal(grad, grad1)


def test_the_weights_multiply_the_policy_term_only():
    w = torch.tensor([[1.5, 0.25, 0.0], [1.0, 2.0, 0.5]])
    logp = torch.full((2, 3), -1.0)
    loss, _ = grpo_loss(logp, logp, None, torch.tensor([1.0, -1.0]), MASK, beta=0.0, loss_type="bnpo", is_weight=w)
    # on-policy ratio 1: per token -A * w; bnpo: mean over the 5 masked tokens
    assert loss.item() == pytest.approx((-1.5 - 0.25 + 1.0 + 2.0 + 0.5) / 5)


def test_mismatch_metrics_merge_micro_batches_and_ranks():
    acc = new_mismatch()
    add_mismatch(acc, rollout_is_weights(OLD, SAMPLER, MASK, "token_mask", 1.5)[1])
    add_mismatch(acc, rollout_is_weights(OLD[1:], OLD[1:] - 0.25, MASK[1:], "token_mask", 1.5)[1])
    m = mismatch_metrics({k: acc[k] for k in ("tokens", "gap_sum", "ratio_sum", "capped")},
                         {k: acc[k] for k in ("gap_max", "ratio_max", "neg_ratio_min")})
    assert m["rollout_logp_gap_mean"] == pytest.approx((1.5 + 0.75) / 8)
    assert m["rollout_logp_gap_max"] == pytest.approx(1.0)
    assert m["rollout_is_ratio_min"] == pytest.approx(E(-1.0)) and m["rollout_is_ratio_max"] == pytest.approx(E(0.5))
    assert m["rollout_is_ratio_mean"] == pytest.approx((E(0.5) + E(-1.0) + 3 + 3 * E(0.25)) / 8)
    assert m["rollout_is_capped_frac"] == pytest.approx(1 / 8)
    assert mismatch_metrics({"tokens": 0.0}, {}) == {}


def test_the_in_process_engine_gives_no_sampler_logprobs_and_its_card_says_so(tiny):
    from grpo_core.algo.objective import objective_card
    from grpo_core.config.stage import GRPOConfig
    from grpo_core.model.loading import load_policy
    from grpo_core.rollout import engines

    model, tok = load_policy(str(tiny))
    engine = engines.build("auto", tok)
    engine.sync_weights(model)
    batch = engine.generate([{"prompt": "1+1", "gold": "2"}], 2, engines.Sampling(max_new_tokens=3))
    assert batch.sampler_logp is None  # so the trainer passes is_weight=None: the update is untouched
    card = objective_card(GRPOConfig(runtime=dict(model="m", output_dir="o")), 1)
    assert card["rollout_correction"].startswith("none: the in-process engine")
    card = objective_card(GRPOConfig(runtime=dict(model="m", output_dir="o"), sampling=dict(rollout_engine="vllm"),
                                     loss=dict(rollout_is="token_truncate", rollout_is_cap=2.0)), 1)
    assert card["rollout_correction"].startswith("token_truncate: r = exp(old_logp - sampler_logp) per token; "
                                                 "weight min(r, 2)")
