"""The loss entries beyond PPO's token clip: GSPO and CISPO, hand-computed; and the seam itself (one
entry reaches the config, the objective card and the micro-batch weights). The float64 loop
reference for every entry is in test_grpo_loss.py."""

import math

import pytest
import torch

from grpo_core.algo import losses
from grpo_core.algo.losses import grpo_loss
from grpo_core.algo.objective import objective_card
from grpo_core.config.checks import ConfigError
from grpo_core.config.stage import GRPOConfig


def _loss_and_grad(logp_values, old_values, adv, loss_type, **kw):
    logp = torch.tensor(logp_values, dtype=torch.float64, requires_grad=True)
    old = torch.tensor(old_values, dtype=torch.float64)
    mask = torch.ones_like(old, dtype=torch.bool)
    loss, stats = grpo_loss(logp, old, None, torch.tensor(adv, dtype=torch.float64), mask, beta=0.0,
                            loss_type=loss_type, **kw)
    loss.backward()
    return loss.item(), logp.grad, stats


def test_gspo_one_clipped_ratio_per_sequence_hand_computed():
    # sequence 0: log-ratios 0.1, 0.3 -> s = e^0.2 = 1.2214 > 1.1: clipped for A = +1, so no gradient;
    # sequence 1: log-ratios -0.1, 0.1 -> s = 1: loss -A = 2, gradient -A * s / 2 per token = 1
    loss, grad, stats = _loss_and_grad([[-1.0, -1.0], [-1.0, -1.0]], [[-1.1, -1.3], [-0.9, -1.1]],
                                       [1.0, -2.0], "gspo", clip_low=0.1)
    assert loss == pytest.approx((-1.1 + 2.0) / 2)  # per-sequence terms -1.1 (clipped) and 2, mean over 2
    torch.testing.assert_close(grad, torch.tensor([[0.0, 0.0], [0.5, 0.5]], dtype=torch.float64))
    assert stats["clip_frac_high"] == 0.5 and stats["clip_frac_low"] == 0.0  # both tokens of sequence 0
    assert stats["ratio_max"] == pytest.approx(math.exp(0.2))


def test_cispo_keeps_the_gradient_of_clipped_tokens_with_a_capped_weight():
    # token log-ratios 0.5 (r = 1.6487, weight capped at 1.2) and 0 (weight 1); A = 1, token mean
    loss, grad, stats = _loss_and_grad([[-1.0, -2.0]], [[-1.5, -2.0]], [1.0], "cispo", clip_high=0.2)
    assert loss == pytest.approx(-(1.2 * -1.0 + 1.0 * -2.0) / 2)
    torch.testing.assert_close(grad, torch.tensor([[-0.6, -0.5]], dtype=torch.float64))  # PPO's clip: 0, -0.5
    _, ppo_grad, _ = _loss_and_grad([[-1.0, -2.0]], [[-1.5, -2.0]], [1.0], "dapo", clip_high=0.2)
    assert ppo_grad[0, 0] == 0.0
    assert stats["clip_frac_high"] == 0.5


@pytest.mark.parametrize("loss_type, same_as", [("gspo", "grpo"), ("cispo", "dapo")])
def test_on_policy_gradient_equals_the_loss_it_generalises(loss_type, same_as):
    """At old_logp = logp.detach() every ratio is 1: GSPO's gradient is GRPO's (a per-sequence mean of
    A * grad logp) and CISPO's is DAPO's (a token mean)."""
    g = torch.Generator().manual_seed(0)
    logp0 = -torch.rand(6, 5, generator=g, dtype=torch.float64)
    adv = torch.randn(6, generator=g, dtype=torch.float64)
    mask = torch.rand(6, 5, generator=g) < 0.7
    grads = []
    for name in (loss_type, same_as):
        logp = logp0.clone().requires_grad_()
        loss, _ = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, loss_type=name)
        loss.backward()
        grads.append(logp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-14)


def test_every_entry_reaches_the_config_and_the_objective_card():
    for name, entry in losses.LOSS_TYPES.items():
        cfg = GRPOConfig(loss=dict(type=name, clip_low=0.2, clip_high=0.28))
        card = objective_card(cfg, world_size=1)
        assert card["loss_type"] == name and card["normaliser"] == entry.normaliser
        assert "0.8" in card["surrogate"] and "1.28" in card["surrogate"]
    with pytest.raises(ConfigError, match=r"loss\.type: .ppo. is not allowed; use one of grpo, bnpo, dapo, dr_grpo"):
        GRPOConfig(loss=dict(type="ppo"))


def test_a_new_entry_is_one_dict_item(monkeypatch):
    """The seam: a loss added as one entry is accepted by the config and applied by grpo_loss."""
    def zero_term(logp, old_logp, adv, mask, clip_low, clip_high):
        ratio = torch.exp(logp - old_logp)
        return 0 * logp, ratio, mask & False, mask & False

    entry = losses.LossType(zero_term, losses._agg_global_token_mean, losses._weight_global_tokens,
                            "0", "token mean", "nothing")
    monkeypatch.setitem(losses.LOSS_TYPES, "zero", entry)
    assert GRPOConfig(loss=dict(type="zero")).loss.type == "zero"
    logp = torch.zeros(1, 2, requires_grad=True)
    loss, stats = grpo_loss(logp, logp.detach(), None, torch.ones(1), torch.ones(1, 2, dtype=torch.bool),
                            beta=0.0, loss_type="zero")
    assert loss.item() == 0.0 and stats["clip_frac"] == 0.0
    assert losses.micro_batch_weight("zero", 1, 2, 3, 6, global_counts=False) == 0.5
