"""The trainer end to end on a tiny model: it learns a learnable reward, compiled scoring gives
the eager update, the warm-up and dynamic sampling behave, its metrics are means over the rows
they apply to, and the system prompt reaches every prompt it samples.
"""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.train.entry import load_config, main
from tests.helpers import REPO, SEVENS, stage_args
from tests.trainer_helpers import in_process_trainer, trainer_stage


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
        args = trainer_stage(tiny, out, iterations=1, checkpoint=dict(every=1), execution=dict(compile_scoring=flag))
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

    overrides = [a.removeprefix("--set=")
                 for a in trainer_stage(tiny, tmp_path, loss=dict(beta=0.0), sample_every=1000)]
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


def test_warmup_counts_iterations_whatever_mu_is(tiny, tmp_path):
    """warmup_iters=4: iterations 1..3 use 1/4, 2/4, 3/4 of lr with mu=3 as with mu=1 (the
    schedule used to advance once per optimizer step, ending a 4-iteration warm-up inside the
    second iteration at mu=3). The logged lr is the one the iteration used."""
    lrs = {}
    for mu in (1, 3):
        main(trainer_stage(tiny, tmp_path / str(mu), iterations=3, optim=dict(mu=mu, warmup_iters=4, lr=1e-3),
                           checkpoint=dict(every=3)))
        rows = [json.loads(ln) for ln in (tmp_path / str(mu) / "metrics.jsonl").read_text().splitlines()]
        lrs[mu] = [r["lr"] for r in rows]
    assert lrs[1] == lrs[3] == pytest.approx([2.5e-4, 5e-4, 7.5e-4])


def test_dynamic_sampling_with_nothing_informative_leaves_every_row_out_of_the_loss(tiny, tmp_path):
    """No informative group in any round: the drawn batch goes to the update (DDP needs every rank)
    with every row out of the loss, so it takes no step, and its metrics still compute."""
    trainer = in_process_trainer(tiny, tmp_path, rewards=[{"fn": "tests.faulty_rewards:always_zero"}],
                                  sampling=dict(dynamic_sampling=True, max_resample_rounds=1))
    batch, roll = trainer.rollout()
    assert roll["informative_groups"] == 0 and roll["dynamic_rounds"] == 1
    assert batch.loss_rows is not None and not batch.loss_rows.any()
    upd = trainer.update(batch)
    assert upd["num_tokens"] == 0.0 and not trainer.opt.state
    m = trainer.iteration_metrics(1, batch, roll, upd, 1.0)
    assert m["reward/always_zero"] == 0.0 and m["kl"] == 0.0


def test_dynamic_sampling_keeps_informative_groups_and_logs_draws(tiny, tmp_path):
    """DAPO dynamic sampling: all-equal groups are dropped and refilled; draws are logged."""
    main(trainer_stage(tiny, tmp_path, iterations=2, optim=dict(mu=1),
                       sampling=dict(dynamic_sampling=True, max_resample_rounds=2, temperature=0.3),
                       checkpoint=dict(every=2)))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        assert r["dynamic_drawn"] >= 4 and 0 <= r["dynamic_rounds"] <= 2
        assert r["informative_frac_kept"] >= r["informative_frac"]
    assert (tmp_path / "curves.png").stat().st_size > 1000


def test_reward_function_metrics_are_means_over_the_rows_they_apply_to(tiny, tmp_path):
    """reward/<fn> is each function's mean over the rows it returned a number for (it was the
    sum over rows divided by the update's token count)."""
    from grpo_core.data.rewards import target_char_fraction

    trainer = in_process_trainer(tiny, tmp_path, rewards=SEVENS + [
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


def test_the_validation_accuracy_says_how_many_items_it_is_over(tiny, tmp_path):
    """eval_size 500 asks for more arithmetic validation items than there are: eval_n says how many."""
    from grpo_core.data.prompts import eval_rows

    main(trainer_stage(tiny, tmp_path, iterations=2, validation=dict(every=2, size=500), task="arithmetic"))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    cfg = load_config(None, [a.removeprefix("--set=") for a in trainer_stage(tiny, tmp_path, task="arithmetic")])
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
        trainer = in_process_trainer(tmp_path / "gpt2", tmp_path / str(off), disable_dropout=off)
        assert trainer.policy.model.training
        with torch.no_grad():
            a, b = trainer.policy.model(ids).logits, trainer.policy.model(ids).logits
        assert torch.equal(a, b) is same


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
    main(trainer_stage(tiny, tmp_path, iterations=1, optim=dict(mu=1), system_prompt=system,
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
                             trainer_stage(tiny, tmp_path / "again", system_prompt=system, task="arithmetic")])
    info = dist.init(cfg.execution.collective_timeout_s)
    try:
        batch, _ = Trainer(cfg, info).rollout()
    finally:
        dist.cleanup()
    sampled = tok.batch_decode(batch.prompt_ids, skip_special_tokens=True)
    assert all(p.startswith(f"{system}\nUser: What is ") for p in sampled), sampled[:2]
