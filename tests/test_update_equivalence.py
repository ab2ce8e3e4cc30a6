"""One GRPO update, split every way, equals the one-process full-batch update: two torchrun ranks
(gloo) under DDP, with gradient checkpointing, uneven or empty ranks and the batch std;
micro-batches for every loss type; rows left out of the loss add nothing.
"""

import pytest
import torch

from grpo_core.config.pipeline import deep_merge
from grpo_core.train.entry import load_config
from tests.trainer_helpers import ddp_update, in_process_trainer, trainer_stage


def test_torchrun_two_ranks_with_gradient_checkpointing_equal_the_plain_one_process_update(tiny, tmp_path):
    """DDP around the scorer with layers replayed in backward (non-reentrant checkpointing): the
    policy's packed scoring checkpoints its own layers, so it keeps the shared prompt as the
    reference does."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, "dapo")
    two, two_calls = ddp_update(tiny, tmp_path / "two.st", 2, "dapo", micro_batch_groups=1,
                                execution={"gradient_checkpointing": True})
    assert two_calls == 2  # the reference and the policy, each scored with its prompt shared
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("prompts", ["shared", "mixed"])
def test_torchrun_two_ranks_equal_one_process_update_for_dapo(tiny, tmp_path, prompts):
    """Shared prompts take shared-prefix scoring on both sides (under DDP via CompletionScorer,
    one DDP forward per backward); mixed prompts take the full forward."""
    one, one_calls = ddp_update(tiny, tmp_path / "one.st", 1, "dapo", prompts)
    two, two_calls = ddp_update(tiny, tmp_path / "two.st", 2, "dapo", prompts)
    # the reference model and the policy: two shared-prefix scorings per update, or none
    assert (one_calls, two_calls) == ((2, 2) if prompts == "shared" else (0, 0))
    assert max(g.abs().max().item() for g in one.values()) > 1e-4  # a real gradient
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k
    if prompts == "shared":  # bnpo normalises per rank, so the same split gives a different update
        two_bnpo, _ = ddp_update(tiny, tmp_path / "two_bnpo.st", 2, "bnpo", prompts)
        assert any(not torch.allclose(one[k], two_bnpo[k], atol=1e-7, rtol=1e-4) for k in one)


def test_torchrun_micro_batches_accumulate_to_the_one_process_full_batch_gradient(tiny, tmp_path):
    """4 groups: one process, whole batch at once, against two ranks of 2 groups each scored one
    group at a time (DDP no_sync on the first micro-batch, one all-reduce after the second)."""
    one, one_calls = ddp_update(tiny, tmp_path / "one.st", 1, "dapo", groups=4)
    two, two_calls = ddp_update(tiny, tmp_path / "two.st", 2, "dapo", micro_batch_groups=1, groups=4)
    assert (one_calls, two_calls) == (2, 4)  # rank 0: reference + policy, per micro-batch
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k
    half, _ = ddp_update(tiny, tmp_path / "half.st", 1, "dapo", groups=2)  # a different batch: a different gradient
    assert any(not torch.allclose(one[k], half[k], atol=1e-7, rtol=1e-4) for k in one)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_torchrun_uneven_rank_batches_equal_one_process_update(tiny, tmp_path, loss_type):
    """Dynamic sampling can leave ranks with different numbers of groups (here 2 and 1). grpo and
    dr_grpo normalise by the sequence count over all ranks, so a sequence weighs the same on either
    rank and the update equals one process's (a per-rank mean gave gradients 40% off)."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, loss_type, groups=3)
    two, _ = ddp_update(tiny, tmp_path / "two.st", 2, loss_type, groups=3, rank0_groups=2)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_torchrun_a_rank_with_nothing_in_the_loss_leaves_the_update_of_the_others(tiny, tmp_path, loss_type):
    """Rank 0 holds groups 0-1, rank 1 group 2 with loss_rows False (dynamic sampling found nothing
    informative there): the update, with the batch std of scale="batch" too, equals one process's
    on groups 0-1 alone."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, loss_type, scale="batch", groups=2)
    two, _ = ddp_update(tiny, tmp_path / "two.st", 2, loss_type, scale="batch", groups=3, rank0_groups=2,
                        last_rank_empty=True)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


def test_torchrun_batch_scale_uses_the_std_over_all_ranks(tiny, tmp_path):
    """The two halves' reward stds (0.577, 0.479) differ from the whole batch's (0.496): a per-rank
    std would change the update, the all-reduced one leaves it equal to one process's."""
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, "dapo", scale="batch")
    two, _ = ddp_update(tiny, tmp_path / "two.st", 2, "dapo", scale="batch")
    group, _ = ddp_update(tiny, tmp_path / "group.st", 1, "dapo", scale="group")
    assert any(not torch.allclose(one[k], group[k], atol=1e-7, rtol=1e-4) for k in one)  # scale matters
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dapo", "dr_grpo"])
def test_micro_batches_give_the_full_batch_update_for_every_loss_type(tiny, tmp_path, loss_type):
    """One process, 4 groups, beta > 0, mask_truncated, mu=2: the update in micro-batches of 1 and
    of 3 groups (uneven parts) gives the whole batch's gradients and logged statistics."""
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer
    from tests.helpers import fixed_rollout_batch

    results = {}
    for micro in (0, 1, 3):
        cfg = load_config(None, [a.removeprefix("--set=") for a in trainer_stage(
            tiny, tmp_path / str(micro), loss=dict(type=loss_type, beta=0.04, mask_truncated=True),
                                                                          optim=dict(mu=2, max_grad_norm=0.0, lr=1e-7),
                                                                          sampling=dict(max_new_tokens=7),
                                                                          execution=dict(micro_batch_groups=micro))])
        trainer = Trainer(cfg, dist.init())
        batch = fixed_rollout_batch(4)
        batch.advantages = trainer.advantages(batch.rewards)
        stats = trainer.update(batch)
        grads = {n: p.grad.clone() for n, p in trainer.policy.model.named_parameters() if p.grad is not None}
        results[micro] = grads, stats  # the second update's gradient (weights: Adam's first step turns
        # float noise in near-zero gradients into +-lr, so gradients are what compares to tolerance)
    grads, stats = results[0]
    assert max(g.abs().max().item() for g in grads.values()) > 1e-4
    lengths = batch.completion_mask.sum(-1)
    assert stats["num_tokens"] == lengths[lengths < 7].sum().item()  # mask_truncated
    for micro in (1, 3):
        g, s = results[micro]
        for k in grads:
            assert torch.allclose(grads[k], g[k], atol=1e-7, rtol=1e-4), (micro, k)
        for k in ("loss", "pg_loss", "kl", "clip_frac", "ratio_mean", "ratio_max", "entropy", "num_tokens"):
            assert s[k] == pytest.approx(stats[k], rel=1e-5, abs=1e-7), (micro, k)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_rows_outside_the_loss_add_nothing_and_an_empty_update_takes_no_step(tiny, tmp_path, loss_type):
    """A rank left with no informative group under dynamic sampling still runs the update (DDP
    needs every rank) with ``loss_rows`` False: its rows change neither the gradient nor the
    normalisers. With no row left anywhere there is no optimizer step, but the schedule advances."""
    from tests.helpers import fixed_rollout_batch

    kw = dict(loss=dict(type=loss_type), optim=dict(mu=1, max_grad_norm=0.0, lr=1e-2))
    grads = []
    for n, out in ((4, "masked"), (2, "subset")):
        trainer = in_process_trainer(tiny, tmp_path / out, **kw)
        batch = fixed_rollout_batch(4)
        batch.advantages = trainer.advantages(batch.rewards)
        if n == 4:
            batch.loss_rows = torch.arange(16) < 8  # groups 2 and 3 out of the loss
        else:
            batch = batch.select_groups(torch.tensor([True, True, False, False]))
        trainer.update(batch)
        grads.append({k: p.grad.clone() for k, p in trainer.policy.model.named_parameters()})
    assert max(g.abs().max().item() for g in grads[0].values()) > 1e-4
    for k in grads[0]:
        assert torch.allclose(grads[0][k], grads[1][k], atol=1e-7, rtol=1e-4), k

    trainer = in_process_trainer(tiny, tmp_path / "empty", **deep_merge(kw, dict(optim=dict(warmup_iters=2))))
    before = {k: p.detach().clone() for k, p in trainer.policy.model.state_dict().items()}
    batch = fixed_rollout_batch(2)
    batch.advantages = trainer.advantages(batch.rewards)
    batch.loss_rows = torch.zeros(8, dtype=torch.bool)
    stats = trainer.update(batch)
    assert stats["grad_norm"] == 0.0 and stats["num_tokens"] == 0.0 and stats["lr"] == pytest.approx(5e-3)
    assert not trainer.opt.state  # AdamW never stepped (its moments would move zero-gradient weights)
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.model.state_dict().items())
    assert trainer.sched.get_last_lr()[0] == pytest.approx(1e-2)
