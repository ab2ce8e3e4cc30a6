"""Group advantages and the k3 KL estimate (grpo_core.algo.core): hand-computed values, the float64
loop reference, low precision, the batch std from moments, and input checks.
"""
import math

import pytest
import torch

from grpo_core.algo.core import MAX_LOG_RATIO, group_advantages, informative_mask, k3_kl
from tests.algo_reference import SCALES, ref_advantages


def test_group_advantages_hand_computed():
    # rewards [1,0,0,1], G=2 -> groups [1,0] and [0,1], both with mean 0.5
    # Bessel std per group = sqrt(((1-.5)^2 + (0-.5)^2) / (2-1)) = sqrt(0.5) = 0.70711
    # -> advantages +-0.5 / (0.70711 + 1e-4) = +-0.70701
    r = torch.tensor([1.0, 0.0, 0.0, 1.0])
    a = 0.5 / (math.sqrt(0.5) + 1e-4)
    torch.testing.assert_close(group_advantages(r, 2), torch.tensor([a, -a, -a, a]))
    # batch std: mean 0.5, Bessel var = 4 * 0.25 / (4-1) = 1/3 -> std 0.57735 -> +-0.5 / (0.57735 + 1e-4) = +-0.86588
    b = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    torch.testing.assert_close(group_advantages(r, 2, scale="batch"), torch.tensor([b, -b, -b, b]))
    # none (Dr. GRPO): just r - group_mean
    torch.testing.assert_close(group_advantages(r, 2, scale="none"), torch.tensor([0.5, -0.5, -0.5, 0.5]))


@pytest.mark.parametrize("scale", SCALES)
def test_group_advantages_match_loop_reference(scale):
    rewards = torch.tensor([0.3, 1.7, -2.0, 0.1, 0.1, 0.1, 5.0, 0.0, 0.25, 0.9, 0.9, 0.8], dtype=torch.float64)
    got = group_advantages(rewards, 3, scale=scale)
    torch.testing.assert_close(got, torch.tensor(ref_advantages(rewards, 3, scale), dtype=torch.float64))


@pytest.mark.parametrize("scale", SCALES)
def test_all_equal_group_advantage_is_exactly_zero(scale):
    # float32 mean([0.9, 0.9, 0.9]) is 0.9 - 6e-8, so plain centring leaves +6e-8 (and / (std + 0) would make it O(1));
    # the explicit guard must still return exactly 0, even with eps = 0
    r = torch.tensor([0.9, 0.9, 0.9, 0.7, 0.7, 0.7, 0.0, 1.0, 0.25])
    assert (r[:3] - r[:3].mean() != 0).all()  # the trap is real
    adv = group_advantages(r, 3, scale=scale, eps=0.0)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert (adv[6:] != 0).all()


def test_group_advantages_upcast_low_precision():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.bfloat16)
    adv = group_advantages(r, 2)
    assert adv.dtype == torch.float32
    torch.testing.assert_close(adv, group_advantages(r.float(), 2))
    assert group_advantages(torch.tensor([1, 0, 2, 2]), 2).dtype == torch.float32  # integer rewards


def test_informative_mask():
    r = torch.tensor([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.0001])
    assert informative_mask(r, 2).tolist() == [False, True, False, True]


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(group_size=1), "group_size"),
        (dict(group_size=3), "group_size"),  # 4 rewards are not divisible by 3
        (dict(group_size=2, scale="std"), "scale"),
        (dict(group_size=2, eps=-1.0), "eps"),
    ],
)
def test_group_advantages_validation(kwargs, field):
    with pytest.raises(ValueError, match=field):
        group_advantages(torch.tensor([1.0, 0.0, 0.0, 1.0]), **kwargs)


def test_scale_error_lists_allowed_values():
    with pytest.raises(ValueError, match="'group', 'batch', 'none'"):
        group_advantages(torch.ones(4), 2, scale="std")


def test_informative_mask_validation():
    with pytest.raises(ValueError, match="group_size"):
        informative_mask(torch.ones(5), 2)


def test_batch_std_override_and_std_from_moments():
    """A shard's advantages with the whole batch's std equal the whole batch's advantages."""
    from grpo_core.algo.core import std_from_moments
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.0, 1.0, 1.0], dtype=torch.float64)
    assert std_from_moments(r.sum().item(), (r * r).sum().item(), r.numel()) == pytest.approx(r.std().item())
    assert std_from_moments(1.0, 1.0, 1) == 0.0  # one value: no spread, not a division by zero
    whole = group_advantages(r, 4, scale="batch")
    shard = group_advantages(r[4:], 4, scale="batch", batch_std=r.std().item())
    torch.testing.assert_close(shard, whole[4:])
    assert not torch.allclose(group_advantages(r[4:], 4, scale="batch"), whole[4:])  # the shard's own std
    with pytest.raises(ValueError, match="batch_std.*scale='batch'"):
        group_advantages(r, 4, scale="group", batch_std=0.5)


def test_k3_kl_hand_computed():
    # d = ref - logp. d = ln2: 2 - 0.693147 - 1 = 0.306853; d = -ln2: 0.5 + 0.693147 - 1 = 0.193147; d = 0: 0
    logp = torch.tensor([0.0, math.log(2), -1.3], dtype=torch.float64)
    ref = torch.tensor([math.log(2), 0.0, -1.3], dtype=torch.float64)
    expected = torch.tensor([1 - math.log(2), 0.5 + math.log(2) - 1, 0.0], dtype=torch.float64)
    torch.testing.assert_close(k3_kl(logp, ref), expected)


def test_k3_kl_clamped_and_nonnegative():
    # d = 100 is clamped to MAX_LOG_RATIO = 20: exp(20) - 20 - 1, finite
    out = k3_kl(torch.tensor([0.0, 0.0]), torch.tensor([100.0, -100.0]))
    assert torch.isfinite(out).all()
    # d = -100 is clamped to -20: exp(-20) + 20 - 1
    expected = [math.exp(MAX_LOG_RATIO) - MAX_LOG_RATIO - 1, math.exp(-MAX_LOG_RATIO) + MAX_LOG_RATIO - 1]
    torch.testing.assert_close(out, torch.tensor(expected))
    assert (k3_kl(torch.randn(1000), torch.randn(1000)) >= 0).all()
