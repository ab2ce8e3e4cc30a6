"""Tests for grpo_core.algo.core and grpo_core.algo.losses: hand-computed values, a float64 loop reference
for every loss entry, DDP and micro-batch split invariance."""

import math

import pytest
import torch

from grpo_core.algo import losses
from grpo_core.algo.core import (
    MAX_LOG_RATIO,
    group_advantages,
    informative_mask,
    k3_kl,
    masked_mean,
    token_entropy,
    token_logprobs,
)
from grpo_core.algo.losses import grpo_loss, micro_batch_weight

LOSS_TYPES = tuple(losses.LOSS_TYPES)
SCALES = ("group", "batch", "none")
MAX_LEN = 7  # dr_grpo's constant denominator in the reference tests


# ----------------------------------------------------------------------------- loop references (float64, loops)

def ref_advantages(rewards, G, scale, eps=1e-4):
    """Plain-Python group advantages with Bessel std."""
    r = [float(x) for x in rewards]
    batch_mean = sum(r) / len(r)
    batch_std = math.sqrt(sum((x - batch_mean) ** 2 for x in r) / (len(r) - 1))
    out = []
    for g in range(len(r) // G):
        grp = r[g * G:(g + 1) * G]
        mean = sum(grp) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (G - 1))
        for x in grp:
            if all(y == grp[0] for y in grp):
                out.append(0.0)
            elif scale == "group":
                out.append((x - mean) / (std + eps))
            elif scale == "batch":
                out.append((x - mean) / (batch_std + eps))
            else:
                out.append(x - mean)
    return out


def _ref_clip(r, lo, hi):
    """clip(r, lo, hi) on a 0-d tensor, the bound as a constant (no gradient) when it applies."""
    if r.item() < lo:
        return torch.tensor(lo, dtype=torch.float64)
    if r.item() > hi:
        return torch.tensor(hi, dtype=torch.float64)
    return r


def _ref_ppo(r, rc, A):
    unclipped, clipped = r * A, rc * A
    return -clipped if clipped.item() < unclipped.item() else -unclipped


def ref_loss(logp, old, ref, adv, mask, clip_low, clip_high, beta, loss_type, max_len=None):
    """Token-by-token loss on 0-d tensors so autograd gives the reference gradient; returns (loss, clip counts).

    grpo/bnpo/dapo/dr_grpo: PPO clip per token; gspo: one ratio per sequence, exp of the mean
    log-ratio, on every token of it; cispo: -clip(r).detached * A * logp per token."""
    ch = clip_low if clip_high is None else clip_high
    lo, hi = 1 - clip_low, 1 + ch
    B, T = logp.shape
    seq_sums, seq_counts, n_low, n_high = [], [], 0, 0
    for b in range(B):
        total, count = torch.zeros((), dtype=torch.float64), 0
        tokens = [t for t in range(T) if mask[b][t]]
        A = float(adv[b])
        if loss_type == "gspo" and tokens:
            s = torch.exp(sum(logp[b, t] - old[b, t] for t in tokens) / len(tokens))
            seq_term = _ref_ppo(s, _ref_clip(s, lo, hi), A)
        for t in tokens:
            r = torch.exp(logp[b, t] - old[b, t])
            if loss_type == "gspo":
                term = seq_term
                n_low += int(A < 0 and s.item() < lo)
                n_high += int(A > 0 and s.item() > hi)
            elif loss_type == "cispo":
                term = -float(min(max(r.item(), lo), hi)) * A * logp[b, t]
                n_low += int(r.item() < lo)
                n_high += int(r.item() > hi)
            else:
                term = _ref_ppo(r, _ref_clip(r, lo, hi), A)
                n_low += int(A < 0 and r.item() < lo)
                n_high += int(A > 0 and r.item() > hi)
            if beta != 0:
                d = ref[b, t] - logp[b, t]
                term = term + beta * (torch.exp(d) - d - 1)
            total, count = total + term, count + 1
        seq_sums.append(total)
        seq_counts.append(count)
    n_tok = sum(seq_counts)
    if loss_type in ("grpo", "gspo"):
        loss = sum(s / c if c > 0 else s * 0 for s, c in zip(seq_sums, seq_counts)) / B
    elif loss_type in ("bnpo", "dapo", "cispo"):
        loss = sum(seq_sums) / max(n_tok, 1)
    else:
        loss = sum(seq_sums) / (B * max_len)
    return loss, n_low / max(n_tok, 1), n_high / max(n_tok, 1)


def random_batch(seed, groups=4, G=3, T=6):
    """float64 batch with one all-equal group, some clipped ratios and some all-zero mask rows."""
    g = torch.Generator().manual_seed(seed)
    B = groups * G
    rewards = torch.randint(0, 3, (B,), generator=g).double()
    rewards[:G] = 1.0  # group 0 is uninformative
    old = -torch.rand(B, T, generator=g, dtype=torch.float64) * 3 - 0.1
    logp = old + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)  # ratios e^N(0, .3^2): many clipped
    ref = old + 0.5 * torch.randn(B, T, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < 0.7
    mask[1] = False
    mask[5] = False
    return rewards, logp, old, ref, mask


# ----------------------------------------------------------------------------- advantages

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


# ----------------------------------------------------------------------------- k3 KL

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


# ----------------------------------------------------------------------------- loss: hand-computed

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


# ----------------------------------------------------------------------------- loss: loop reference

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


# ----------------------------------------------------------------------------- dapo under DDP

def _policy_grad(w, feats, old, adv, mask, rows, **kw):
    """Gradient of one 'rank's' loss w.r.t. shared weights w; logp = -softplus(feats @ w) per token."""
    w = w.detach().clone().requires_grad_()
    logp = -torch.nn.functional.softplus(feats[rows] @ w)  # [b, T]
    loss, _ = grpo_loss(logp, old[rows], None, adv[rows], mask[rows], beta=0.0, **kw)
    loss.backward()
    return w.grad


def _linear_policy_problem(seed: int, B: int, T: int, F: int, keep: float, noise: float = 0.2):
    """A float64 toy policy logp = -softplus(feats @ w) with old log-probs, advantages and a mask."""
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(B, T, F, generator=g, dtype=torch.float64)
    w = torch.randn(F, generator=g, dtype=torch.float64)
    old = -torch.nn.functional.softplus(feats @ w) + noise * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.randn(B, generator=g, dtype=torch.float64)
    mask = torch.rand(B, T, generator=g) < keep
    return feats, w, old, adv, mask


def test_dapo_split_invariance_across_ranks_and_microbatches():
    B, T = 8, 6
    feats, w, old, adv, mask = _linear_policy_problem(3, B, T, 4, 0.6)
    mask[0, :] = True  # make rank 0 much longer than rank 1 so per-rank normalisation would differ
    mask[1, :] = True
    total = int(mask.sum())
    full = _policy_grad(w, feats, old, adv, mask, slice(0, B), loss_type="dapo")

    # 2 ranks x 2 micro-batches: sum grads within a rank (accumulation), average across ranks (DDP)
    ranks = [[slice(0, 1), slice(1, 3)], [slice(3, 6), slice(6, 8)]]
    rank_grads = [sum(_policy_grad(w, feats, old, adv, mask, mb, loss_type="dapo", global_token_count=total,
                                   world_size=2) for mb in mbs) for mbs in ranks]
    torch.testing.assert_close((rank_grads[0] + rank_grads[1]) / 2, full, rtol=1e-12, atol=1e-14)

    # the same split with local (bnpo) normalisation is NOT invariant: this is what dapo fixes
    bnpo = [_policy_grad(w, feats, old, adv, mask, slice(0, 3), loss_type="bnpo"),
            _policy_grad(w, feats, old, adv, mask, slice(3, 8), loss_type="bnpo")]
    assert not torch.allclose((bnpo[0] + bnpo[1]) / 2, full, rtol=1e-3)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "gspo", "cispo"])
def test_global_counts_make_uneven_rank_splits_and_micro_batches_invariant(loss_type):
    """Ranks holding 3 and 5 sequences (dynamic sampling keeps different numbers per rank), each in
    two micro-batches weighted by micro_batch_weight: DDP's mean equals one process's gradient."""
    B, T = 8, 6
    feats, w, old, adv, mask = _linear_policy_problem(5, B, T, 4, 0.6)
    mask[0, :] = True
    counts = dict(global_token_count=int(mask.sum()), global_sequence_count=B, world_size=2, max_completion_length=T)
    full = _policy_grad(w, feats, old, adv, mask, slice(0, B), loss_type=loss_type, max_completion_length=T)
    ranks = [[slice(0, 1), slice(1, 3)], [slice(3, 4), slice(4, 8)]]
    rank_grads = []
    for mbs in ranks:
        rows = sum(m.stop - m.start for m in mbs)
        tokens = sum(int(mask[m].sum()) for m in mbs)
        rank_grads.append(sum(micro_batch_weight(loss_type, m.stop - m.start, rows, int(mask[m].sum()), tokens)
                              * _policy_grad(w, feats, old, adv, mask, m, loss_type=loss_type, **counts)
                              for m in mbs))
    torch.testing.assert_close((rank_grads[0] + rank_grads[1]) / 2, full, rtol=1e-12, atol=1e-14)
    # without the global sequence count, the 3-row rank's sequences weigh 5/3 of the others'
    local = [_policy_grad(w, feats, old, adv, mask, r, loss_type=loss_type, max_completion_length=T,
                          global_token_count=counts["global_token_count"], world_size=2)
             for r in (slice(0, 3), slice(3, 8))]
    if loss_type not in ("dapo", "cispo"):  # the token-mean losses need only the token count
        assert not torch.allclose((local[0] + local[1]) / 2, full, rtol=1e-3)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("global_counts", [True, False])
def test_micro_batch_weights_sum_micro_losses_to_the_batch_loss(loss_type, global_counts):
    """One rank, 7 sequences in micro-batches of 2, 4 and 1: the weighted micro-batch losses and
    gradients sum to the whole batch's, with or without global counts passed to grpo_loss."""
    B, T = 7, 5
    feats, w, old, adv, mask = _linear_policy_problem(9, B, T, 3, 0.5, noise=0.3)
    mask[6] = False  # an empty sequence in a micro-batch of its own
    kw = dict(loss_type=loss_type, max_completion_length=T)
    if global_counts:
        kw.update(global_token_count=int(mask.sum()), global_sequence_count=B)
    full = _policy_grad(w, feats, old, adv, mask, slice(0, B), **kw)
    parts = [slice(0, 2), slice(2, 6), slice(6, 7)]
    total = sum(micro_batch_weight(loss_type, p.stop - p.start, B, int(mask[p].sum()), int(mask.sum()),
                                   global_counts=global_counts) * _policy_grad(w, feats, old, adv, mask, p, **kw)
                for p in parts)
    torch.testing.assert_close(total, full, rtol=1e-12, atol=1e-14)


def test_micro_batch_weight_validation():
    with pytest.raises(ValueError, match="loss_type must be one of"):
        micro_batch_weight("ppo", 1, 2, 1, 2)
    with pytest.raises(ValueError, match=r"rows must be in 1\.\.total_rows=2, got 3"):
        micro_batch_weight("grpo", 3, 2, 1, 2)


# ----------------------------------------------------------------------------- chunked log-probs and entropy

@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1024])
def test_token_logprobs_match_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    B, T, V = 3, 5, 11
    logits = (3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g, dtype=torch.float64)

    got = token_logprobs(logits, targets, temperature=0.7, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (grad_ref,) = torch.autograd.grad((want * upstream).sum(), logits)

    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)


def test_token_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, temperature=1.3, chunk_size=2), (logits,))


def test_token_logprobs_bfloat16_upcasts_output_keeps_grad_dtype():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 7, (2, 3))
    out = token_logprobs(logits, targets, chunk_size=4)
    out.sum().backward()
    assert out.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_token_entropy_matches_reference(chunk_size):
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(token_entropy(logits, temperature=0.7, chunk_size=chunk_size), want)
    # uniform logits -> entropy log V
    torch.testing.assert_close(token_entropy(torch.zeros(1, 2, 8)), torch.full((1, 2), math.log(8)))


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_token_logprobs_saves_no_float32_copy_of_logits():
    # plain autograd over upcast chunks would save float32 [B*T, V] for backward; we save bf16 logits + [B*T] lse
    logits = torch.randn(4, 8, 64).to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        token_logprobs(logits, torch.randint(0, 64, (4, 8)), chunk_size=8)
    assert sum(saved) <= logits.numel() * logits.element_size() + 4 * 8 * (4 + 8)  # logits + lse + targets


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
