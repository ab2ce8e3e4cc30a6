"""The trainer's resume on a tiny model: after a crash, after the gate fired, into a fresh output
dir, along a chain of flow resumes, past a corrupt latest checkpoint; the weights equal an
uninterrupted run's bitwise and the warm-up position comes from the iteration.
"""
import json
from pathlib import Path

import pytest

from grpo_core.train.entry import main
from tests.faults import InjectedFault, crash_after_iteration, crash_before_final_model
from tests.helpers import same_weights
from tests.trainer_helpers import in_process_trainer, trainer_stage


def test_resume_after_crash_is_bitwise_equal_to_uninterrupted(tiny, tmp_path):
    main(trainer_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(trainer_stage(tiny, tmp_path / "crashed"))
    ckpts = sorted(p.name for p in (tmp_path / "crashed" / "checkpoints").iterdir())
    assert ckpts[-1] == "ckpt-000004"
    summary = main(trainer_stage(tiny, tmp_path / "crashed"))
    assert summary["iterations_run"] == 6
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")
    its = [json.loads(ln)["iteration"] for ln in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert its == [1, 2, 3, 4, 5, 6]  # no duplicated iterations after the resume


def test_resume_after_the_gate_fired_finishes_the_stage_without_training_on(tiny, tmp_path):
    """The gate fires at iteration 2 and the process dies before the final model is saved: the
    re-run finishes from that checkpoint (it used to train iterations 3..6 past the gate)."""
    gate = dict(gate=dict(metric="reward", threshold=0.0, patience=2), checkpoint=dict(every=10))
    straight = main(trainer_stage(tiny, tmp_path / "straight", **gate))
    assert straight["iterations_run"] == 2 and straight["promoted_by_gate"]
    with crash_before_final_model(), pytest.raises(InjectedFault):
        main(trainer_stage(tiny, tmp_path / "crashed", **gate))
    resumed = main(trainer_stage(tiny, tmp_path / "crashed", **gate))
    assert (resumed["iterations_run"], resumed["promoted_by_gate"], resumed["resumed_from_iteration"]) == (2, True, 2)
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")


def test_resume_into_a_fresh_output_dir_restores_the_metrics_history(tiny, tmp_path):
    """A flow ``resume`` runs the failed stage in a new output_dir, resuming from the origin run's
    checkpoints: the summary's first point, reward trend and curves still cover iterations 1..6."""
    straight = main(trainer_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(trainer_stage(tiny, tmp_path / "origin"))
    resumed = main(trainer_stage(tiny, tmp_path / "resumed", runtime=dict(resume_from=[str(tmp_path / "origin")])))
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
    straight = main(trainer_stage(tiny, tmp_path / "straight"))
    sync = {r: str(tmp_path / "store" / r) for r in "ABC"}
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(trainer_stage(tiny, tmp_path / "A", runtime=dict(sync_uri=sync["A"])))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(trainer_stage(tiny, tmp_path / "B", runtime=dict(sync_uri=sync["B"], resume_from=[sync["B"], sync["A"]])))
    assert (Path(sync["B"]) / "checkpoints" / "ckpt-000004" / "manifest.json").exists()
    resumed = main(trainer_stage(tiny, tmp_path / "C",
                                 runtime=dict(sync_uri=sync["C"], resume_from=[sync["C"], sync["B"]])))
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
        main(trainer_stage(tiny, tmp_path / "A", runtime=dict(sync_uri=sync["A"])))
    partial = Path(sync["B"]) / "checkpoints" / "ckpt-000004"
    partial.mkdir(parents=True)
    shutil.copyfile(Path(sync["A"]) / "checkpoints" / "ckpt-000004" / "model.safetensors",
                    partial / "model.safetensors")
    storage.write_text(storage.join(sync["B"], RESUME_CHAIN), json.dumps([sync["A"]]))
    assert resume_chain(sync["B"]) == [sync["B"], sync["A"]]
    chain = [sync["C"], *resume_chain(sync["B"])]
    resumed = main(trainer_stage(tiny, tmp_path / "C", runtime=dict(sync_uri=sync["C"], resume_from=chain),
                                 iterations=4))
    assert resumed["resumed_from_iteration"] == 4
    main(trainer_stage(tiny, tmp_path / "B2", runtime=dict(sync_uri=sync["B"], resume_from=[sync["B"], sync["A"]]),
                       iterations=4))
    assert checkpoint.verify(partial)


def test_corrupt_latest_checkpoint_falls_back_to_previous(tiny, tmp_path):
    main(trainer_stage(tiny, tmp_path, iterations=4, checkpoint=dict(keep=3)))
    latest = tmp_path / "checkpoints" / "ckpt-000004" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:-100])  # truncated
    from grpo_core.train import checkpoint
    with pytest.warns(UserWarning, match="checksum"):
        found = checkpoint.latest_local(tmp_path / "checkpoints")
    assert found.name == "ckpt-000002"


def test_resume_takes_the_warmup_position_from_the_iteration_not_the_saved_counter(tiny, tmp_path):
    """A checkpoint written when the schedule stepped once per optimizer step (mu=3: 6 steps by
    iteration 2) resumes at iteration 3's rate, 3/4 of lr under warmup_iters=4, not at full lr."""
    old = in_process_trainer(tiny, tmp_path, optim=dict(warmup_iters=4, lr=1e-3, mu=3))
    for _ in range(6):
        old.opt.step()
        old.sched.step()
    assert old.sched.get_last_lr()[0] == pytest.approx(1e-3)
    old.state["iteration"] = 2
    old.save_checkpoint(2)
    resumed = in_process_trainer(tiny, tmp_path, optim=dict(warmup_iters=4, lr=1e-3, mu=3))
    assert resumed.resume() == 2
    assert resumed.sched.get_last_lr()[0] == pytest.approx(7.5e-4)
    assert resumed.opt.param_groups[0]["lr"] == pytest.approx(7.5e-4)
