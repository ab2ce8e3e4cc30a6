"""The trainer end to end on a tiny model: it learns, DDP matches one process, resume is exact."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import deep_merge
from grpo_core.train.entry import load_config, main
from tests.faults import InjectedFault, crash_after_iteration, crash_before_final_model
from tests.helpers import REPO, SEVENS, same_weights, stage_args


def test_learns_a_learnable_reward(tiny, tmp_path):
    """'Emit the character 7': mean reward rises from <= 0.2 to >= 0.8 within 40 iterations."""
    summary = main(stage_args(runtime=dict(model=str(tiny), output_dir=str(tmp_path)), rewards=SEVENS, iterations=40,
                              optim=dict(lr=3e-3), loss=dict(beta=0.0), prompts_per_iter=8, checkpoint=dict(every=40),
                              sampling=dict(max_new_tokens=32)))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rewards = [round(r["reward"], 3) for r in rows]
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5  # window means: one lucky iteration does not pass
    assert rows[0]["reward"] <= 0.2 and first <= 0.3, rewards
    assert last >= 0.8 and min(rewards[-5:]) >= 0.6, rewards
    for key in ("reward", "reward_std", "informative_frac", "kl", "loss", "clip_frac", "entropy",
                "completion_len", "truncated_frac", "grad_norm", "tokens_per_s", "time_generate",
                "time_reward", "time_update"):
        assert key in rows[-1], key
    assert summary["iterations_run"] == 40
    assert summary["last"]["reward"] == rows[-1]["reward"] and "logged_at_ms" not in summary["last"]
    trend = summary["reward_trend"]  # first/last 10-iteration means with a Welch 95% interval
    assert trend["window"] == 10 and trend["first"] == pytest.approx(sum(r["reward"] for r in rows[:10]) / 10)
    assert trend["ci_low"] > 0, trend
    card = json.loads((tmp_path / "objective.json").read_text())
    assert card["loss_type"] == "dapo" and "global batch" in card["normaliser"]
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").num_parameters() > 0


def _stage(tiny, out, **kw):
    base = dict(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=6,
                optim=dict(lr=3e-3, mu=2), loss=dict(beta=0.04), prompts_per_iter=4,
                sampling=dict(group_size=4, max_new_tokens=12), checkpoint=dict(every=2))
    return stage_args(**deep_merge(base, kw))


def test_resume_after_crash_is_bitwise_equal_to_uninterrupted(tiny, tmp_path):
    main(_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "crashed"))
    ckpts = sorted(p.name for p in (tmp_path / "crashed" / "checkpoints").iterdir())
    assert ckpts[-1] == "ckpt-000004"
    summary = main(_stage(tiny, tmp_path / "crashed"))
    assert summary["iterations_run"] == 6
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")
    its = [json.loads(ln)["iteration"] for ln in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert its == [1, 2, 3, 4, 5, 6]  # no duplicated iterations after the resume


def test_resume_after_the_gate_fired_finishes_the_stage_without_training_on(tiny, tmp_path):
    """The gate fires at iteration 2 and the process dies before the final model is saved: the
    re-run finishes from that checkpoint (it used to train iterations 3..6 past the gate)."""
    gate = dict(gate=dict(metric="reward", threshold=0.0, patience=2), checkpoint=dict(every=10))
    straight = main(_stage(tiny, tmp_path / "straight", **gate))
    assert straight["iterations_run"] == 2 and straight["promoted_by_gate"]
    with crash_before_final_model(), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "crashed", **gate))
    resumed = main(_stage(tiny, tmp_path / "crashed", **gate))
    assert (resumed["iterations_run"], resumed["promoted_by_gate"], resumed["resumed_from_iteration"]) == (2, True, 2)
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")


def test_resume_into_a_fresh_output_dir_restores_the_metrics_history(tiny, tmp_path):
    """A flow ``resume`` runs the failed stage in a new output_dir, resuming from the origin run's
    checkpoints: the summary's first point, reward trend and curves still cover iterations 1..6."""
    straight = main(_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "origin"))
    resumed = main(_stage(tiny, tmp_path / "resumed", runtime=dict(resume_from=[str(tmp_path / "origin")])))
    assert resumed["resumed_from_iteration"] == 4
    its = [json.loads(ln)["iteration"] for ln in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert its == [1, 2, 3, 4, 5, 6]
    assert json.dumps(resumed["reward_trend"]) == json.dumps(straight["reward_trend"])  # (NaN intervals)
    assert (resumed["first"]["iteration"], resumed["first"]["reward"]) == (1, straight["first"]["reward"])
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "resumed" / "final")


def test_a_resume_of_a_resume_that_failed_before_its_first_checkpoint_loses_nothing(tiny, tmp_path):
    """Flow runs A -> B (resume of A) -> C (resume of B): each searches only itself and its direct
    origin. B resumed from A's checkpoint 4 and failed before writing one of its own, so C would
    have found nothing and restarted at 0; B now republishes the checkpoint it resumed from."""
    straight = main(_stage(tiny, tmp_path / "straight"))
    sync = {r: str(tmp_path / "store" / r) for r in "ABC"}
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "A", runtime=dict(sync_uri=sync["A"])))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "B", runtime=dict(sync_uri=sync["B"], resume_from=[sync["B"], sync["A"]])))
    assert (Path(sync["B"]) / "checkpoints" / "ckpt-000004" / "manifest.json").exists()
    resumed = main(_stage(tiny, tmp_path / "C", runtime=dict(sync_uri=sync["C"], resume_from=[sync["C"], sync["B"]])))
    assert resumed["resumed_from_iteration"] == 4 and resumed["iterations_run"] == 6
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "C" / "final")
    assert straight["iterations_run"] == 6


def test_a_copy_cut_short_is_republished_and_the_chain_reaches_the_first_attempt(tiny, tmp_path):
    """B (a resume of A) was killed while copying A's checkpoint 4 into its own storage: a copy
    without its manifest. C (a resume of B) searches C, B and, through B's recorded chain, A, so
    it resumes at 4; and republishing replaces B's partial copy instead of skipping the name."""
    import shutil

    from grpo_core.io import storage
    from grpo_core.pipeline.steps import RESUME_CHAIN, resume_chain
    from grpo_core.train import checkpoint

    sync = {r: str(tmp_path / "store" / r) for r in "ABC"}
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "A", runtime=dict(sync_uri=sync["A"])))
    partial = Path(sync["B"]) / "checkpoints" / "ckpt-000004"
    partial.mkdir(parents=True)
    shutil.copyfile(Path(sync["A"]) / "checkpoints" / "ckpt-000004" / "model.safetensors",
                    partial / "model.safetensors")
    storage.write_text(storage.join(sync["B"], RESUME_CHAIN), json.dumps([sync["A"]]))
    assert resume_chain(sync["B"]) == [sync["B"], sync["A"]]
    chain = [sync["C"], *resume_chain(sync["B"])]
    resumed = main(_stage(tiny, tmp_path / "C", runtime=dict(sync_uri=sync["C"], resume_from=chain), iterations=4))
    assert resumed["resumed_from_iteration"] == 4
    main(_stage(tiny, tmp_path / "B2", runtime=dict(sync_uri=sync["B"], resume_from=[sync["B"], sync["A"]]),
                iterations=4))
    assert checkpoint.verify(partial)


COMPILED_RUN = """import sys, torch
from grpo_core.model.loading import unwrap
from grpo_core.train.entry import main
main(sys.argv[1:])
bare = torch.nn.Linear(2, 2)
print("UNWRAP", unwrap(torch.compile(bare)) is bare)
print("GRAPHS", torch._dynamo.utils.counters["stats"]["unique_graphs"])
"""


def test_compiled_scoring_gives_the_eager_update(tiny, tmp_path):
    """compile_scoring=True scores through torch.compile'd policy and reference: iteration 1 (same
    rollouts, two updates: mu=2 scores the old policy too) reports eager's loss, KL and entropy.
    The compiled stage runs in a process of its own, as the flow's torchrun steps do (this pytest
    process may hold metaflow's vendored typing_extensions, which torch's compiler cannot load with)."""
    rows = {}
    for flag in (False, True):
        out = tmp_path / ("compiled" if flag else "eager")
        args = _stage(tiny, out, iterations=1, checkpoint=dict(every=1), execution=dict(compile_scoring=flag))
        if flag:
            env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
            run = subprocess.run([sys.executable, "-c", COMPILED_RUN, *args], env=env, capture_output=True,
                                 text=True, timeout=900)
            assert run.returncode == 0, run.stderr[-4000:]
            graphs = int(run.stdout.split("GRAPHS")[-1])
            assert graphs >= 2, f"compiled scoring did not run ({graphs} graphs)"  # policy (with grad), reference
        else:
            main(args)
        rows[flag] = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert rows[True]["reward"] == rows[False]["reward"]  # the decoder does not use the compiled module
    for key in ("loss", "kl", "entropy", "grad_norm"):
        assert rows[True][key] == pytest.approx(rows[False][key], rel=1e-3, abs=1e-6), key
    saved = [load_file(str(tmp_path / d / "final" / "model.safetensors")) for d in ("eager", "compiled")]
    assert saved[0].keys() == saved[1].keys()  # the bare model is saved, not the compiled wrapper
    assert "UNWRAP True" in run.stdout  # models.unwrap strips torch.compile's wrapper


def test_divergence_alarm_is_reported_once_per_evaluation(tiny, tmp_path, capsys):
    """The alarm reads evaluation points only: it is printed at the evaluation that raises it, not
    again on every iteration until the next one (the default run printed one alarm 25 times)."""
    from grpo_core.policy import dist
    from grpo_core.train.entry import load_config
    from grpo_core.train.trainer import Trainer

    overrides = [a.removeprefix("--set=") for a in _stage(tiny, tmp_path, loss=dict(beta=0.0), sample_every=1000)]
    trainer = Trainer(load_config(None, overrides), dist.init())
    rewards, accs = [0.1, 0.2, 0.3, 0.4, 0.5], {2: 0.5, 4: 0.4, 6: 0.3}  # reward up, accuracy down
    batch = None
    for it, r in enumerate(rewards + [0.7, 0.8], start=2):  # from 2: iteration 1 logs sample completions
        m = {"iteration": it, "reward": r, "informative_frac": 0.5, "kl": 0.0, "completion_len": 1.0}
        if it in accs:
            m["eval_accuracy"] = accs[it]
        trainer._remember(m)
        trainer.recorder.record(m, batch, trainer.state["history"])
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "divergence" in ln]
    assert len(warnings) == 1 and "iterations 2..6" in warnings[0], warnings


def test_corrupt_latest_checkpoint_falls_back_to_previous(tiny, tmp_path):
    main(_stage(tiny, tmp_path, iterations=4, checkpoint=dict(keep=3)))
    latest = tmp_path / "checkpoints" / "ckpt-000004" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:-100])  # truncated
    from grpo_core.train import checkpoint
    with pytest.warns(UserWarning, match="checksum"):
        found = checkpoint.latest_local(tmp_path / "checkpoints")
    assert found.name == "ckpt-000002"


def _update(tiny, out, nproc, loss_type, prompts="shared", scale="group", micro_batch_groups=0, groups=2,
            rank0_groups=0, last_rank_empty=False, **extra):
    script = str(REPO / "tests" / "ddp_update_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
           if nproc > 1 else [sys.executable, script])
    args = [str(tiny), str(out), loss_type, prompts, scale, str(micro_batch_groups), str(groups), str(rank0_groups),
            "last-rank-empty" if last_rank_empty else "-", json.dumps(extra)]
    run = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd[2:4])} exited {run.returncode}:\n{run.stderr[-6000:]}"
    grads = load_file(str(out))
    return grads, grads.pop("shared_prefix_calls").item()


def test_torchrun_two_ranks_with_gradient_checkpointing_equal_the_plain_one_process_update(tiny, tmp_path):
    """DDP around the scorer with layers replayed in backward (non-reentrant checkpointing): the
    policy forward runs prompt and completion together, the reference keeps its shared prefix."""
    one, _ = _update(tiny, tmp_path / "one.st", 1, "dapo")
    two, two_calls = _update(tiny, tmp_path / "two.st", 2, "dapo", micro_batch_groups=1,
                               execution={"gradient_checkpointing": True})
    assert two_calls == 1  # the reference only
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("prompts", ["shared", "mixed"])
def test_torchrun_two_ranks_equal_one_process_update_for_dapo(tiny, tmp_path, prompts):
    """Shared prompts take shared-prefix scoring on both sides (under DDP via CompletionScorer,
    one DDP forward per backward); mixed prompts take the full forward."""
    one, one_calls = _update(tiny, tmp_path / "one.st", 1, "dapo", prompts)
    two, two_calls = _update(tiny, tmp_path / "two.st", 2, "dapo", prompts)
    # the reference model and the policy: two shared-prefix scorings per update, or none
    assert (one_calls, two_calls) == ((2, 2) if prompts == "shared" else (0, 0))
    assert max(g.abs().max().item() for g in one.values()) > 1e-4  # a real gradient
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k
    if prompts == "shared":  # bnpo normalises per rank, so the same split gives a different update
        two_bnpo, _ = _update(tiny, tmp_path / "two_bnpo.st", 2, "bnpo", prompts)
        assert any(not torch.allclose(one[k], two_bnpo[k], atol=1e-7, rtol=1e-4) for k in one)


def test_torchrun_micro_batches_accumulate_to_the_one_process_full_batch_gradient(tiny, tmp_path):
    """4 groups: one process, whole batch at once, against two ranks of 2 groups each scored one
    group at a time (DDP no_sync on the first micro-batch, one all-reduce after the second)."""
    one, one_calls = _update(tiny, tmp_path / "one.st", 1, "dapo", groups=4)
    two, two_calls = _update(tiny, tmp_path / "two.st", 2, "dapo", micro_batch_groups=1, groups=4)
    assert (one_calls, two_calls) == (2, 4)  # rank 0: reference + policy, per micro-batch
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    assert one.keys() == two.keys()
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k
    half, _ = _update(tiny, tmp_path / "half.st", 1, "dapo", groups=2)  # a different batch: a different gradient
    assert any(not torch.allclose(one[k], half[k], atol=1e-7, rtol=1e-4) for k in one)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo"])
def test_torchrun_uneven_rank_batches_equal_one_process_update(tiny, tmp_path, loss_type):
    """Dynamic sampling can leave ranks with different numbers of groups (here 2 and 1). grpo and
    dr_grpo normalise by the sequence count over all ranks, so a sequence weighs the same on either
    rank and the update equals one process's (a per-rank mean gave gradients 40% off)."""
    one, _ = _update(tiny, tmp_path / "one.st", 1, loss_type, groups=3)
    two, _ = _update(tiny, tmp_path / "two.st", 2, loss_type, groups=3, rank0_groups=2)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_torchrun_a_rank_with_nothing_in_the_loss_leaves_the_update_of_the_others(tiny, tmp_path, loss_type):
    """Rank 0 holds groups 0-1, rank 1 group 2 with loss_rows False (dynamic sampling found nothing
    informative there): the update, with the batch std of scale="batch" too, equals one process's
    on groups 0-1 alone."""
    one, _ = _update(tiny, tmp_path / "one.st", 1, loss_type, scale="batch", groups=2)
    two, _ = _update(tiny, tmp_path / "two.st", 2, loss_type, scale="batch", groups=3, rank0_groups=2,
                     last_rank_empty=True)
    assert max(g.abs().max().item() for g in one.values()) > 1e-4
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
        cfg = load_config(None, [a.removeprefix("--set=") for a in _stage(
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


def _in_process_trainer(tiny, out, **kw):
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    return Trainer(load_config(None, [a.removeprefix("--set=") for a in _stage(tiny, out, **kw)]), dist.init())


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_rows_outside_the_loss_add_nothing_and_an_empty_update_takes_no_step(tiny, tmp_path, loss_type):
    """A rank left with no informative group under dynamic sampling still runs the update (DDP
    needs every rank) with ``loss_rows`` False: its rows change neither the gradient nor the
    normalisers. With no row left anywhere there is no optimizer step, but the schedule advances."""
    from tests.helpers import fixed_rollout_batch

    kw = dict(loss=dict(type=loss_type), optim=dict(mu=1, max_grad_norm=0.0, lr=1e-2))
    grads = []
    for n, out in ((4, "masked"), (2, "subset")):
        trainer = _in_process_trainer(tiny, tmp_path / out, **kw)
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

    trainer = _in_process_trainer(tiny, tmp_path / "empty", **deep_merge(kw, dict(optim=dict(warmup_iters=2))))
    before = {k: p.detach().clone() for k, p in trainer.policy.model.state_dict().items()}
    batch = fixed_rollout_batch(2)
    batch.advantages = trainer.advantages(batch.rewards)
    batch.loss_rows = torch.zeros(8, dtype=torch.bool)
    stats = trainer.update(batch)
    assert stats["grad_norm"] == 0.0 and stats["num_tokens"] == 0.0 and stats["lr"] == pytest.approx(5e-3)
    assert not trainer.opt.state  # AdamW never stepped (its moments would move zero-gradient weights)
    assert all(torch.equal(before[k], v) for k, v in trainer.policy.model.state_dict().items())
    assert trainer.sched.get_last_lr()[0] == pytest.approx(1e-2)


def test_warmup_counts_iterations_whatever_mu_is(tiny, tmp_path):
    """warmup_iters=4: iterations 1..3 use 1/4, 2/4, 3/4 of lr with mu=3 as with mu=1 (the
    schedule used to advance once per optimizer step, ending a 4-iteration warm-up inside the
    second iteration at mu=3). The logged lr is the one the iteration used."""
    lrs = {}
    for mu in (1, 3):
        main(_stage(tiny, tmp_path / str(mu), iterations=3, optim=dict(mu=mu, warmup_iters=4, lr=1e-3),
                    checkpoint=dict(every=3)))
        rows = [json.loads(ln) for ln in (tmp_path / str(mu) / "metrics.jsonl").read_text().splitlines()]
        lrs[mu] = [r["lr"] for r in rows]
    assert lrs[1] == lrs[3] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])


def test_resume_takes_the_warmup_position_from_the_iteration_not_the_saved_counter(tiny, tmp_path):
    """A checkpoint written when the schedule stepped once per optimizer step (mu=3: 6 steps by
    iteration 2) resumes at iteration 3's rate, 3/4 of lr under warmup_iters=4, not at full lr."""
    old = _in_process_trainer(tiny, tmp_path, optim=dict(warmup_iters=4, lr=1e-3, mu=3))
    for _ in range(6):
        old.opt.step()
        old.sched.step()
    assert old.sched.get_last_lr()[0] == pytest.approx(1e-3)
    old.state["iteration"] = 2
    old.save_checkpoint(2)
    resumed = _in_process_trainer(tiny, tmp_path, optim=dict(warmup_iters=4, lr=1e-3, mu=3))
    assert resumed.resume() == 2
    assert resumed.sched.get_last_lr()[0] == pytest.approx(7.5e-4)
    assert resumed.opt.param_groups[0]["lr"] == pytest.approx(7.5e-4)


def test_dynamic_sampling_with_nothing_informative_leaves_every_row_out_of_the_loss(tiny, tmp_path):
    """No informative group in any round: the drawn batch goes to the update (DDP needs every rank)
    with every row out of the loss, so it takes no step, and its metrics still compute."""
    trainer = _in_process_trainer(tiny, tmp_path, rewards=[{"fn": "tests.faulty_rewards:always_zero"}],
                                  sampling=dict(dynamic_sampling=True, max_resample_rounds=1))
    batch, roll = trainer.rollout()
    assert roll["informative_groups"] == 0 and roll["dynamic_rounds"] == 1
    assert batch.loss_rows is not None and not batch.loss_rows.any()
    upd = trainer.update(batch)
    assert upd["num_tokens"] == 0.0 and not trainer.opt.state
    m = trainer.iteration_metrics(1, batch, roll, upd, 1.0)
    assert m["reward/always_zero"] == 0.0 and m["kl"] == 0.0


def test_reward_function_metrics_are_means_over_the_rows_they_apply_to(tiny, tmp_path):
    """reward/<fn> is each function's mean over the rows it returned a number for (it was the
    sum over rows divided by the update's token count)."""
    from grpo_core.data.rewards import target_char_fraction

    trainer = _in_process_trainer(tiny, tmp_path, rewards=SEVENS + [
        {"fn": "tests.faulty_rewards:sevens_on_even_rows", "weight": 0.5}],
                                  sampling=dict(max_new_tokens=12))
    batch, roll = trainer.rollout()
    m = trainer.iteration_metrics(1, batch, roll, trainer.update(batch), 1.0)
    sevens = target_char_fraction(batch.prompts, batch.completions)
    assert max(sevens) > 0  # the check can tell a mean from a sum or a wrong divisor
    assert m["reward/target_char_fraction"] == pytest.approx(sum(sevens) / len(sevens))
    assert m["reward/sevens_on_even_rows"] == pytest.approx(sum(sevens[::2]) / len(sevens[::2]))
    assert m["reward"] == pytest.approx(sum(s + 0.5 * s * (i % 2 == 0) for i, s in enumerate(sevens)) / len(sevens),
                                        rel=1e-6)


def test_prompts_that_do_not_split_across_ranks_are_refused_not_dropped(tiny, tmp_path):
    """3 prompts on 2 ranks: sharding would drop one every iteration, silently (only the pipeline
    config checked this; ``python -m grpo_core.train`` under torchrun did not)."""
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    cfg = load_config(None, [a.removeprefix("--set=") for a in _stage(tiny, tmp_path, prompts_per_iter=3)])
    with pytest.raises(ConfigError, match=r"stage 'grpo'\.prompts_per_iter: 3 prompts cannot be split across 2 ranks"):
        Trainer(cfg, dist.DistInfo(0, 2, 0, torch.device("cpu")))


def test_the_validation_accuracy_says_how_many_items_it_is_over(tiny, tmp_path):
    """eval_size 500 asks for more arithmetic validation items than there are: eval_n says how many."""
    from grpo_core.data.prompts import eval_rows

    main(_stage(tiny, tmp_path, iterations=2, validation=dict(every=2, size=500), task="arithmetic"))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, [a.removeprefix("--set=") for a in _stage(tiny, tmp_path, task="arithmetic")])
    available = len(eval_rows(cfg, 10**6))
    assert "eval_n" not in rows[0] and rows[1]["eval_n"] == available < 500


def test_dropout_is_off_in_the_policy_unless_asked_for(tmp_path):
    """A GPT-2-style checkpoint with dropout 0.1: by default two train-mode forwards agree (the
    sampled, the old and the updated policy are one network); disable_dropout=false keeps it."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from grpo_core.model.loading import build_tiny

    _, tok = build_tiny("llama", 16, 1, 2, seed=0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128,
                               resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1, pad_token_id=tok.pad_token_id,
                               eos_token_id=tok.eos_token_id)).save_pretrained(tmp_path / "gpt2")
    tok.save_pretrained(tmp_path / "gpt2")
    ids = torch.randint(3, len(tok), (2, 12))
    for off, same in ((True, True), (False, False)):
        trainer = _in_process_trainer(tmp_path / "gpt2", tmp_path / str(off), disable_dropout=off)
        assert trainer.policy.model.training
        with torch.no_grad():
            a, b = trainer.policy.model(ids).logits, trainer.policy.model(ids).logits
        assert torch.equal(a, b) is same


def test_torchrun_batch_scale_uses_the_std_over_all_ranks(tiny, tmp_path):
    """The two halves' reward stds (0.577, 0.479) differ from the whole batch's (0.496): a per-rank
    std would change the update, the all-reduced one leaves it equal to one process's."""
    one, _ = _update(tiny, tmp_path / "one.st", 1, "dapo", scale="batch")
    two, _ = _update(tiny, tmp_path / "two.st", 2, "dapo", scale="batch")
    group, _ = _update(tiny, tmp_path / "group.st", 1, "dapo", scale="group")
    assert any(not torch.allclose(one[k], group[k], atol=1e-7, rtol=1e-4) for k in one)  # scale matters
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("override,match", [
    ("sampling.group_size=1", r"sampling\.group_size"), ("loss.clip_low=-0.1", r"loss\.clip_low"),
    ("loss.beta=-1", r"loss\.beta"), ("loss.type=ppo", r"loss\.type.*grpo, bnpo, dapo, dr_grpo"),
    ("sampling.grop_size=4", "Did you mean 'group_size'"),
    ("group_size=4", r"belongs in the 'sampling' group: stage\.sampling\.group_size"),
    ("keep=2", r"belongs in the 'checkpoint' group: stage\.checkpoint\.keep"),
    ("optim.lr=\"fast\"", r"stage\.optim\.lr"), ("gate.metric=\"eval_accuracy\"", r"validation\.every"),
    ("rewards=[{\"func\": \"x\"}]", "rewards\\[0\\]"),
    ("sampling.sampler=\"gumbel\"", "sampler.*inverse_cdf, multinomial"),
    ("execution.collective_timeout_s=0",
     r"stage 'grpo'\.execution\.collective_timeout_s: must be a finite number > 0"),
    ("optim=3", r"stage\.optim must be a table"), ("optim.lr.x=1", r"stage\.optim\.lr = \{'x': 1\} has type dict"),
])
def test_bad_stage_config_names_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("text,match", [
    ('{"iterations": 4,,}', r"bad\.json: not valid JSON at line 1"), ("[1, 2]", r"bad\.json: expected a JSON object"),
    (None, r"bad\.json: cannot read it"),
])
def test_bad_stage_config_file_names_the_file(tmp_path, text, match):
    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(path), [])


def test_bad_reward_path_is_reported_before_training(tiny, tmp_path):
    with pytest.raises(ValueError, match="grpo_core.nope:f"):
        main(_stage(tiny, tmp_path, rewards=[{"fn": "grpo_core.nope:f"}]))


def test_dynamic_sampling_keeps_informative_groups_and_logs_draws(tiny, tmp_path):
    """DAPO dynamic sampling: all-equal groups are dropped and refilled; draws are logged."""
    main(_stage(tiny, tmp_path, iterations=2, optim=dict(mu=1),
                sampling=dict(dynamic_sampling=True, max_resample_rounds=2, temperature=0.3), checkpoint=dict(every=2)))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["dynamic_drawn"] >= 4 and 0 <= r["dynamic_rounds"] <= 2
        assert r["informative_frac_kept"] >= r["informative_frac"]
    assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_end_worker_process_exits_0_with_output_flushed_only_under_torchrun(under_torchrun):
    """Under torchrun (RANK and LOCAL_RANK set) a finished worker leaves at once with status 0
    and its unflushed stdout/stderr written; alone the call returns and the script goes on."""
    script = ("import sys; from grpo_core.policy import dist; print('out', end=''); sys.stderr.write('err'); "
              "dist.end_worker_process(); raise SystemExit(3)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    if under_torchrun:
        env.update(RANK="0", LOCAL_RANK="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == ((0 if under_torchrun else 3), "out", "err")


def test_system_prompt_reaches_rollouts_evaluation_and_the_objective_card(tiny, tmp_path):
    """A stage's system prompt is in every prompt it samples and evaluates, and the objective card and
    MLflow params carry one prompt exactly as rendered. Rollouts and in-stage evaluation both
    sample through ``rollout.render_prompts``; the samples log shows which prompt text was used."""
    from transformers import AutoTokenizer

    from grpo_core.rollout.generate import render_prompts

    system = "You add numbers."
    main(_stage(tiny, tmp_path, iterations=1, optim=dict(mu=1), system_prompt=system,
                validation=dict(every=1, size=4), task="arithmetic"))
    card = json.loads((tmp_path / "objective.json").read_text())
    assert card["system_prompt"] == system
    rendered = card["rendered_prompt_example"]
    assert rendered.startswith(f"{system}\nUser: What is ") and rendered.endswith("\nAssistant: ")
    tok = AutoTokenizer.from_pretrained(tiny)
    question = rendered.removeprefix(f"{system}\nUser: ").removesuffix("\nAssistant: ")
    assert render_prompts(tok, [question], system) == [rendered]
    assert render_prompts(tok, [question]) != [rendered]  # no system turn without one

    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    cfg = load_config(None, [a.removeprefix("--set=") for a in
                             _stage(tiny, tmp_path / "again", system_prompt=system, task="arithmetic")])
    info = dist.init(cfg.execution.collective_timeout_s)
    try:
        batch, _ = Trainer(cfg, info).rollout()
    finally:
        dist.cleanup()
    sampled = tok.batch_decode(batch.prompt_ids, skip_special_tokens=True)
    assert all(p.startswith(f"{system}\nUser: What is ") for p in sampled), sampled[:2]


def test_empty_system_prompt_is_refused():
    with pytest.raises(ConfigError, match=r"system_prompt: is empty; omit it"):
        load_config(None, [a.removeprefix("--set=") for a in stage_args(runtime=dict(model="m"), system_prompt=" ")])
