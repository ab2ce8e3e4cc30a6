"""The trainer end to end on a tiny model: it learns, DDP matches one process, resume is exact."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config import ConfigError
from grpo_core.train import load_config, main
from tests.helpers import REPO, same_weights, stage_args, tiny_model_dir

SEVENS = [{"fn": "grpo_core.rewards:target_char_fraction", "weight": 1.0}]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def test_learns_a_learnable_reward(tiny, tmp_path):
    """'Emit the character 7': mean reward rises from <= 0.2 to >= 0.8 within 40 iterations."""
    summary = main(stage_args(model=str(tiny), output_dir=str(tmp_path), rewards=SEVENS, iterations=40,
                              lr=3e-3, beta=0.0, prompts_per_iter=8, save_every=40, max_new_tokens=32))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["reward"] <= 0.2
    assert max(r["reward"] for r in rows) >= 0.8, [round(r["reward"], 3) for r in rows]
    for key in ("reward", "reward_std", "informative_frac", "kl", "loss", "clip_frac", "entropy",
                "completion_len", "truncated_frac", "grad_norm", "tokens_per_s", "time_generate",
                "time_reward", "time_update"):
        assert key in rows[-1], key
    assert summary["iterations_run"] == 40
    trend = summary["reward_trend"]  # first/last 10-iteration means with a Welch 95% interval
    assert trend["window"] == 10 and trend["first"] == pytest.approx(sum(r["reward"] for r in rows[:10]) / 10)
    assert trend["ci_low"] > 0, trend
    card = json.loads((tmp_path / "objective.json").read_text())
    assert card["loss_type"] == "dapo" and "global batch" in card["normaliser"]
    from transformers import AutoModelForCausalLM
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "final").num_parameters() > 0


def _stage(tiny, out, **kw):
    base = dict(model=str(tiny), output_dir=str(out), rewards=SEVENS, iterations=6, lr=3e-3, beta=0.04,
                prompts_per_iter=4, group_size=4, save_every=2, max_new_tokens=12, mu=2)
    return stage_args(**{**base, **kw})


def test_resume_after_crash_is_bitwise_equal_to_uninterrupted(tiny, tmp_path):
    main(_stage(tiny, tmp_path / "straight"))
    with pytest.raises(RuntimeError, match="injected failure at iteration 5"):
        main(_stage(tiny, tmp_path / "crashed", fail_at_iteration=5))
    ckpts = sorted(p.name for p in (tmp_path / "crashed" / "checkpoints").iterdir())
    assert ckpts[-1] == "ckpt-000004"
    summary = main(_stage(tiny, tmp_path / "crashed"))
    assert summary["iterations_run"] == 6
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")
    its = [json.loads(ln)["iteration"] for ln in (tmp_path / "crashed" / "metrics.jsonl").read_text().splitlines()]
    assert its == [1, 2, 3, 4, 5, 6]  # no duplicated iterations after the resume


COMPILED_RUN = """import sys, torch
from grpo_core.models import unwrap
from grpo_core.train import main
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
        args = _stage(tiny, out, iterations=1, save_every=1, compile_scoring=flag)
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
    from grpo_core import dist
    from grpo_core.train import load_config
    from grpo_core.trainer import Trainer

    overrides = [a.removeprefix("--set=") for a in _stage(tiny, tmp_path, beta=0.0, sample_every=1000)]
    trainer = Trainer(load_config(None, overrides), dist.init())
    rewards, accs = [0.1, 0.2, 0.3, 0.4, 0.5], {2: 0.5, 4: 0.4, 6: 0.3}  # reward up, accuracy down
    batch = None
    for it, r in enumerate(rewards + [0.7, 0.8], start=2):  # from 2: iteration 1 logs sample completions
        m = {"iteration": it, "reward": r, "informative_frac": 0.5, "kl": 0.0, "completion_len": 1.0}
        if it in accs:
            m["eval_accuracy"] = accs[it]
        trainer._record(m, batch)
    warnings = [ln for ln in capsys.readouterr().out.splitlines() if "divergence" in ln]
    assert len(warnings) == 1 and "iterations 2..6" in warnings[0], warnings


def test_corrupt_latest_checkpoint_falls_back_to_previous(tiny, tmp_path):
    main(_stage(tiny, tmp_path, iterations=4, keep_checkpoints=3))
    latest = tmp_path / "checkpoints" / "ckpt-000004" / "model.safetensors"
    latest.write_bytes(latest.read_bytes()[:-100])  # truncated
    from grpo_core import checkpoint
    with pytest.warns(UserWarning, match="checksum"):
        found = checkpoint.latest_local(tmp_path / "checkpoints")
    assert found.name == "ckpt-000002"


def _update(tiny, out, nproc, loss_type, prompts="shared", scale="group"):
    script = str(REPO / "tests" / "ddp_update_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
           if nproc > 1 else [sys.executable, script])
    run = subprocess.run(cmd + [str(tiny), str(out), loss_type, prompts, scale], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd[2:4])} exited {run.returncode}:\n{run.stderr[-6000:]}"
    grads = load_file(str(out))
    return grads, grads.pop("shared_prefix_calls").item()


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
    ("group_size=1", "group_size"), ("clip_low=-0.1", "clip_low"), ("beta=-1", "beta"),
    ("loss_type=ppo", "loss_type.*grpo, bnpo, dapo, dr_grpo"), ("grop_size=4", "Did you mean 'group_size'"),
    ("lr=\"fast\"", "stage.lr"), ("gate_metric=\"eval_accuracy\"", "eval_every"),
    ("rewards=[{\"func\": \"x\"}]", "rewards\\[0\\]"),
    ("sampler=\"gumbel\"", "sampler.*inverse_cdf, multinomial"),
    ("collective_timeout_s=0", r"stage 'grpo'\.collective_timeout_s: must be a finite number > 0"),
])
def test_bad_stage_config_names_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("text,match", [
    ('{"lr": 1e-4,,}', r"bad\.json: not valid JSON at line 1"), ("[1, 2]", r"bad\.json: expected a JSON object"),
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
    main(_stage(tiny, tmp_path, iterations=2, mu=1, dynamic_sampling=True, max_resample_rounds=2,
                temperature=0.3, save_every=2))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["dynamic_drawn"] >= 4 and 0 <= r["dynamic_rounds"] <= 2
        assert r["informative_frac_kept"] >= r["informative_frac"]
    assert (tmp_path / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("under_torchrun", [True, False])
def test_end_worker_process_exits_0_with_output_flushed_only_under_torchrun(under_torchrun):
    """Under torchrun (RANK and LOCAL_RANK set) a finished worker leaves at once with status 0
    and its unflushed stdout/stderr written; alone the call returns and the script goes on."""
    script = ("import sys; from grpo_core import dist; print('out', end=''); sys.stderr.write('err'); "
              "dist.end_worker_process(); raise SystemExit(3)")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK")}
    if under_torchrun:
        env.update(RANK="0", LOCAL_RANK="0")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO,
                         env={**env, "PYTHONPATH": str(REPO)}, timeout=120)
    assert (out.returncode, out.stdout, out.stderr) == ((0 if under_torchrun else 3), "out", "err")
