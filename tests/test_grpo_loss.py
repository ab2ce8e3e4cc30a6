"""grpo_loss (grpo_core.algo.losses): clipping, aggregation and the KL term by hand on single
tokens, input checks, and every loss entry against the float64 loop reference.
"""
import math

import pytest
import torch

from grpo_core.algo.core import group_advantages
from grpo_core.algo.losses import grpo_loss
from tests.algo_reference import LOSS_TYPES, MAX_LEN, SCALES, random_batch, ref_advantages, ref_loss


def one_token(log_ratio, adv, **kw):
    """Single-token loss with logp - old_logp = log_ratio; returns (loss, d loss / d logp, stats)."""
    logp = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    loss, stats = grpo_loss(logp, torch.zeros(1, 1, dtype=torch.float64), None, torch.tensor([adv]),
                            torch.ones(1, 1, dtype=torch.bool), beta=0.0, **kw)
    loss.backward()
    return loss.item(), logp.grad.item(), stats


def test_clip_high_positive_advantage():
    # r = e^0.3 = 1.34986 > 1.2, A = +1: min(1.34986, 1.2) = 1.2 -> loss -1.2, clipped branch -> zero gradient
    loss, grad, stats = one_token(0.3, 1.0)
    assert loss == pytest.approx(-1.2) and grad == 0.0
    assert stats["clip_frac_high"] == 1.0 and stats["clip_frac_low"] == 0.0 and stats["clip_frac"] == 1.0
    assert stats["ratio_max"] == pytest.approx(math.exp(0.3))
    # clip_high = 0.28: cap 1.28 < 1.34986 -> still clipped, loss -1.28
    assert one_token(0.3, 1.0, clip_high=0.28)[0] == pytest.approx(-1.28)
    # r = e^0.2 = 1.22140: clipped at 1.2 when symmetric, unclipped under clip_high = 0.28 (grad = -A * r)
    assert one_token(0.2, 1.0)[:2] == (pytest.approx(-1.2), 0.0)
    assert one_token(0.2, 1.0, clip_high=0.28)[:2] == (pytest.approx(-math.exp(0.2)), pytest.approx(-math.exp(0.2)))


def test_clip_not_active_for_negative_advantage_above_range():
    # r = e^0.3, A = -1: min(-1.34986, -1.2) = -1.34986 -> loss +1.34986, unclipped: d(-r*A)/dlogp = r = 1.34986
    loss, grad, stats = one_token(0.3, -1.0)
    assert loss == pytest.approx(math.exp(0.3)) and grad == pytest.approx(math.exp(0.3))
    assert stats["clip_frac"] == 0.0


def test_clip_low_negative_advantage():
    # r = e^-0.3 = 0.74082 < 0.8, A = -1: min(-0.74082, -0.8) = -0.8 -> loss 0.8, zero gradient
    loss, grad, stats = one_token(-0.3, -1.0)
    assert loss == pytest.approx(0.8) and grad == 0.0
    assert stats["clip_frac_low"] == 1.0 and stats["clip_frac_high"] == 0.0


def test_aggregations_hand_computed():
    # ratio 1 (old = logp), beta 0 -> per-token loss = -A.  A = [1, -4, 5]
    # mask rows: [1,1,0] (2 tokens of -1), [1,0,0] (1 token of +4), [0,0,0] (empty)
    logp = torch.full((3, 3), -1.0)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -4.0, 5.0])

    def loss(loss_type, **kw):
        return grpo_loss(logp, logp, None, adv, mask, beta=0.0, loss_type=loss_type, **kw)[0].item()

    assert loss("grpo") == pytest.approx((-1 + 4 + 0) / 3)  # per-seq means -1, 4, 0 -> mean 1.0
    assert loss("bnpo") == pytest.approx((-2 + 4) / 3)  # sum 2 over 3 tokens
    assert loss("dapo") == pytest.approx((-2 + 4) / 3)  # no global count: same as bnpo
    assert loss("dapo", global_token_count=6, world_size=2) == pytest.approx(2 * 2 / 6)  # sum * ws / global
    assert loss("dapo", global_token_count=torch.tensor(6), world_size=2) == pytest.approx(2 * 2 / 6)
    assert loss("dr_grpo", max_completion_length=4) == pytest.approx(2 / (3 * 4))  # sum / (B * L)


def test_kl_term_and_stats():
    # one token, ratio 1, A = 0: loss = beta * k3; ref - logp = ln2 -> k3 = 1 - ln2 = 0.306853; 0.04 * that = 0.012274
    logp = torch.zeros(1, 2)
    ref = torch.tensor([[math.log(2), 5.0]])
    mask = torch.tensor([[True, False]])  # the second token is padding and must not count
    loss, stats = grpo_loss(logp, logp, ref, torch.zeros(1), mask, beta=0.04, loss_type="bnpo")
    assert loss.item() == pytest.approx(0.04 * (1 - math.log(2)), rel=1e-5)
    assert stats["kl"] == pytest.approx(1 - math.log(2), rel=1e-5)
    assert stats["pg_loss"] == 0.0 and stats["num_tokens"] == 1.0


def test_ratio_one_gives_zero_clip_and_nonzero_gradient():
    # on-policy (old = logp.detach()): loss value is -mean(A) but d/dlogp_t = -A_b / n_tokens for bnpo
    g = torch.Generator().manual_seed(0)
    logp = (-torch.rand(4, 5, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=torch.float64)
    mask = torch.ones(4, 5, dtype=torch.bool)
    loss, stats = grpo_loss(logp, logp.detach(), None, adv, mask, beta=0.0, loss_type="bnpo")
    loss.backward()
    assert stats["clip_frac"] == 0.0 and stats["ratio_mean"] == 1.0 and stats["ratio_max"] == 1.0
    torch.testing.assert_close(logp.grad, (-adv[:, None] / 20).expand(4, 5))


def test_padding_garbage_is_ignored():
    logp = torch.tensor([[-1.0, float("nan")]], requires_grad=True)
    old = torch.tensor([[-1.2, float("-inf")]])
    loss, stats = grpo_loss(logp, old, old, torch.tensor([1.0]), torch.tensor([[True, False]]))
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and logp.grad[0, 1] == 0
    assert all(math.isfinite(v) for v in stats.values())


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(loss_type="token_mean"), "loss_type"),
        (dict(clip_low=-0.1), "clip_low"),
        (dict(clip_high=-0.1), "clip_high"),
        (dict(beta=-0.1), "beta"),
        (dict(loss_type="dr_grpo"), "max_completion_length"),
        (dict(ref_logp=None, beta=0.04), "ref_logp"),
        (dict(old_logp=torch.zeros(2, 4)), "old_logp"),
        (dict(ref_logp=torch.zeros(3, 3)), "ref_logp"),
        (dict(mask=torch.ones(2, 2, dtype=torch.bool)), "mask"),
        (dict(advantages=torch.zeros(2, 1)), "advantages"),
        (dict(world_size=0), "world_size"),
    ],
)
def test_grpo_loss_validation(kwargs, field):
    args = dict(logp=torch.zeros(2, 3), old_logp=torch.zeros(2, 3), ref_logp=torch.zeros(2, 3),
                advantages=torch.zeros(2), mask=torch.ones(2, 3, dtype=torch.bool))
    args.update(kwargs)
    with pytest.raises(ValueError, match=field):
        grpo_loss(**args)


def test_ref_none_allowed_when_beta_zero():
    logp = torch.zeros(2, 3)
    _, stats = grpo_loss(logp, logp, None, torch.ones(2), torch.ones(2, 3, dtype=torch.bool), beta=0.0)
    assert stats["kl"] == 0.0


@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("clip_high", [None, 0.28])
@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_grpo_loss_matches_loop_reference(loss_type, scale, clip_high, beta):
    rewards, logp0, old, ref, mask = random_batch(seed=10 * LOSS_TYPES.index(loss_type) + SCALES.index(scale))
    adv = group_advantages(rewards, 3, scale=scale)
    torch.testing.assert_close(adv, torch.tensor(ref_advantages(rewards, 3, scale), dtype=torch.float64))

    clip_low = 0.05 if loss_type == "gspo" else 0.2  # a sequence's mean log-ratio varies less than a token's
    clip_high = None if clip_high is None else clip_high * clip_low / 0.2
    logp = logp0.clone().requires_grad_()
    loss, stats = grpo_loss(logp, old, ref, adv, mask, clip_low=clip_low, clip_high=clip_high, beta=beta,
                            loss_type=loss_type, max_completion_length=MAX_LEN)
    loss.backward()

    logp_ref = logp0.clone().requires_grad_()
    expected, frac_low, frac_high = ref_loss(logp_ref, old, ref, adv.tolist(), mask.tolist(), clip_low, clip_high,
                                             beta, loss_type, MAX_LEN)
    expected.backward()

    assert loss.item() == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
    torch.testing.assert_close(logp.grad, logp_ref.grad, rtol=1e-10, atol=1e-12)
    assert logp.grad[~mask].abs().max() == 0  # padding gets no gradient
    assert stats["clip_frac_low"] == pytest.approx(frac_low) and stats["clip_frac_high"] == pytest.approx(frac_high)
    assert stats["clip_frac"] > 0  # the random batch really exercises the clipped branch
    if beta == 0:
        assert stats["pg_loss"] == pytest.approx(expected.item(), rel=1e-12, abs=1e-12)
    diffs = [(ref[b, t] - logp0[b, t]).item() for b in range(mask.shape[0]) for t in range(mask.shape[1]) if mask[b, t]]
    kl_tokens = [math.exp(d) - d - 1 for d in diffs]
    assert stats["kl"] == pytest.approx(sum(kl_tokens) / len(kl_tokens), rel=1e-10)
    assert stats["num_tokens"] == float(mask.sum())
