"""Float64 loop references for grpo_core.algo: group advantages and every loss entry computed token
by token in plain Python, and a random batch that exercises their branches.
"""
import math

import torch

from grpo_core.algo import losses

LOSS_TYPES = tuple(losses.LOSS_TYPES)
SCALES = ("group", "batch", "none")
MAX_LEN = 7  # dr_grpo's constant denominator in the reference tests


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
