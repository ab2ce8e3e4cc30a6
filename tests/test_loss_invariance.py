"""The loss's gradient does not depend on how the batch is split: across DDP ranks (even and
uneven) and micro-batches, with global token and sequence counts and micro_batch_weight, on a
float64 toy policy.
"""

import pytest
import torch

from grpo_core.algo.losses import grpo_loss, micro_batch_weight
from tests.algo_reference import LOSS_TYPES


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
