"""Memory and precision options of a stage: precision = "bf16" (autocast rollouts, scoring and
update with float32 weights and loss math) and gradient_checkpointing.

On CPU (torch's CPU autocast supports bfloat16), so the code path is exercised here; the GPU
check (benchmarks/gpu_check.py) repeats the update comparison on a GPU.
"""
import contextlib
import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stage import GRPOConfig
from grpo_core.train.entry import load_config, main
from tests.helpers import SEVENS, fixed_rollout_batch, stage_args


def _stage(tiny, out, **kw):
    base = dict(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=2,
                optim=dict(lr=3e-3, mu=2), loss=dict(beta=0.04), prompts_per_iter=4,
                sampling=dict(group_size=4, max_new_tokens=12), checkpoint=dict(every=2))
    return stage_args(**deep_merge(base, kw))


def test_precision_must_be_fp32_or_bf16():
    with pytest.raises(ConfigError, match=r"'grpo'\.execution\.precision: 'fp16' is not allowed; use one of"):
        GRPOConfig(execution=dict(precision="fp16"))


def _update(tiny, out, precision, **kw):
    """One trainer's gradients and stats for the fixed batch (mu=2, beta > 0: reference and
    old-policy scoring run too)."""
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    fields = dict(execution=dict(precision=precision), optim=dict(max_grad_norm=0.0, lr=1e-7),
                  sampling=dict(max_new_tokens=7))
    cfg = load_config(None, [a.removeprefix("--set=") for a in _stage(tiny, out, **deep_merge(fields, kw))])
    trainer = Trainer(cfg, dist.init())
    batch = fixed_rollout_batch(2)
    batch.advantages = trainer.advantages(batch.rewards)
    stats = trainer.update(batch)
    grads = {n: p.grad.clone() for n, p in trainer.policy.model.named_parameters() if p.grad is not None}
    return trainer, grads, stats, batch


def test_bf16_update_is_the_fp32_update_to_bfloat16_rounding(tiny, tmp_path):
    """Same batch, same weights: the bf16 gradient points where the fp32 one does (cosine > 0.999
    over all parameters) but is not bitwise equal (autocast did run), every parameter, gradient
    and the reference log-probs stay float32, and the logged statistics agree to bf16 rounding."""
    _, g32, s32, _ = _update(tiny, tmp_path / "fp32", "fp32")
    trainer, g16, s16, batch = _update(tiny, tmp_path / "bf16", "bf16")
    flat32, flat16 = torch.cat([g.flatten() for g in g32.values()]), torch.cat([g16[k].flatten() for k in g32])
    cosine = torch.nn.functional.cosine_similarity(flat32, flat16, dim=0).item()
    assert cosine > 0.999, cosine  # measured 0.99999
    assert not torch.equal(flat32, flat16)  # autocast changed the arithmetic
    assert all(p.dtype == torch.float32 for p in trainer.policy.model.parameters())
    assert all(g.dtype == torch.float32 for g in g16.values())
    assert batch.ref_logp.dtype == torch.float32 and batch.old_logp.dtype == torch.float32
    for key in ("kl", "entropy", "ratio_mean"):
        assert s16[key] == pytest.approx(s32[key], rel=0.05, abs=2e-3), key


def test_bf16_decoder_samples_what_bf16_scoring_scores(tiny):
    """Under autocast the decoder's step logits and the scorer's log-probs are both bf16 matmuls:
    they agree to bf16 rounding (fp32: 1e-4, tests/test_fast_rollout.py), not to fp32's."""
    from grpo_core.model.loading import load_policy
    from grpo_core.policy.scoring import completion_logprobs
    from grpo_core.rollout.batch import RolloutBatch
    from grpo_core.rollout.decode import sample_shared_prefix
    from grpo_core.rollout.generate import completion_mask, encode_prompts

    model, tok = load_policy(str(tiny))
    ids, mask = encode_prompts(tok, ["12+3=", "7*8=", "100-1="], 64)
    G, steps = 3, []
    torch.manual_seed(0)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=10, eos_id=tok.eos_token_id,
                                    pad_id=tok.pad_token_id, step_logits=steps).clone()
        cmask, trunc = completion_mask(comp, tok.eos_token_id)
        batch = RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask, trunc, G, [], [])
        with torch.no_grad():
            logp, _ = completion_logprobs(model, batch, 1.0)
    sampled = torch.log_softmax(torch.stack(steps, 1), -1).gather(-1, comp[..., None])[..., 0]
    assert logp.dtype == torch.float32
    diff = (logp[cmask] - sampled[cmask]).abs().max().item()
    assert diff < 0.1, diff
    with torch.no_grad():
        fp32, _ = completion_logprobs(model, batch, 1.0)
    assert (fp32[cmask] - logp[cmask]).abs().max().item() > 1e-4  # the autocast path was taken


def test_a_bf16_stage_trains_saves_float32_and_records_its_precision(tiny, tmp_path):
    summary = main(_stage(tiny, tmp_path, execution=dict(precision="bf16"), validation=dict(every=1, size=4)))
    assert summary["iterations_run"] == 2
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for key in ("loss", "kl", "grad_norm", "entropy", "eval_accuracy"):
        assert all(torch.isfinite(torch.tensor(r[key])) for r in rows), key
    card = json.loads((tmp_path / "objective.json").read_text())
    assert card["precision"].startswith("bf16 autocast")
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert {t.dtype for t in saved.values()} == {torch.float32}


def test_gradient_checkpointing_gives_the_same_update(tiny, tmp_path):
    """Layers recomputed in backward, the update forward runs prompt and completion together
    (a replayed layer cannot share the prompt's KV cache): the same gradient as the default
    shared-prefix update, to float rounding; the saved model's config is not changed by it."""
    from grpo_core.policy.scoring import _replays_layers

    _, plain, s_plain, _ = _update(tiny, tmp_path / "plain", "fp32")
    trainer, ckpt, s_ckpt, _ = _update(tiny, tmp_path / "ckpt", "fp32", execution={"gradient_checkpointing": True})
    assert _replays_layers(trainer.policy.model)
    assert plain.keys() == ckpt.keys()
    for k in plain:
        assert torch.allclose(plain[k], ckpt[k], rtol=1e-4, atol=1e-7), k
    for key in ("loss", "kl", "entropy", "ratio_mean"):
        assert s_ckpt[key] == pytest.approx(s_plain[key], rel=1e-5, abs=1e-7), key


def test_gradient_checkpointing_stage_saves_a_model_that_generates_with_its_cache(tiny, tmp_path):
    main(_stage(tiny, tmp_path, execution=dict(gradient_checkpointing=True, precision="bf16")))
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config.get("use_cache", True) is True
    assert "gradient_checkpointing" not in json.dumps(config)


@pytest.mark.parametrize("precision,checkpointing", [("bf16", True), ("fp32", False)])
def test_every_phase_runs_in_the_stage_precision_and_only_the_update_replays_layers(
        tiny, tmp_path, monkeypatch, precision, checkpointing):
    """Rollouts, reference and old-policy scoring, the update's forward and evaluation each see
    autocast exactly when precision = "bf16"; checkpointed layers are on in the update's forward
    only (transformers releases that checkpoint any training-mode forward would otherwise drop
    the decoder's KV cache and score old log-probs without their prompt)."""
    import grpo_core.policy.policy as policy_mod
    import grpo_core.rollout.generate as rollout_mod
    import grpo_core.train.trainer as trainer_mod

    seen = {}

    def spy(phase, fn):
        def wrapped(model, *args, **kw):
            layers = [m for m in model.modules() if hasattr(m, "gradient_checkpointing")]
            seen.setdefault(phase, set()).add((torch.is_autocast_enabled("cpu"),
                                               any(m.gradient_checkpointing is True for m in layers)))
            return fn(model, *args, **kw)
        return wrapped

    for module, name, phase in ((rollout_mod, "generate_rollouts", "rollout"),
                                (policy_mod, "scored_without_grad", "ref_old"),
                                (policy_mod, "completion_logprobs", "update"),
                                (trainer_mod, "greedy_results", "eval")):
        monkeypatch.setattr(module, name, spy(phase, getattr(module, name)))
    main(_stage(tiny, tmp_path, execution=dict(precision=precision, gradient_checkpointing=checkpointing),
                iterations=1, checkpoint=dict(every=1), validation=dict(every=1, size=4)))
    amp = precision == "bf16"
    assert seen == {"rollout": {(amp, False)}, "ref_old": {(amp, False)}, "update": {(amp, checkpointing)},
                    "eval": {(amp, False)}}, seen


def test_bf16_decoding_casts_each_weight_once_not_every_step(tiny):
    """Autocast keeps its bf16 copy of a weight only outside inference_mode: decoding under
    inference_mode re-cast every matmul weight at every step (bandwidth-bound decoding then reads
    fp32 + bf16 bytes). The decoder switches to no_grad under autocast."""
    from torch.profiler import profile

    from grpo_core.model.loading import load_policy
    from grpo_core.rollout.decode import sample_shared_prefix
    from grpo_core.rollout.generate import encode_prompts

    model, tok = load_policy(str(tiny))
    ids, mask = encode_prompts(tok, ["12+3=", "7*8="], 64)
    steps, weights = 12, sum(isinstance(m, torch.nn.Linear) for m in model.modules())

    def casts(outer):
        with torch.autocast("cpu", dtype=torch.bfloat16), outer, profile() as p:
            sample_shared_prefix(model, ids, mask, 2, max_new_tokens=steps, eos_id=-1, pad_id=tok.pad_token_id)
        return sum(e.count for e in p.key_averages() if e.key == "aten::_to_copy")

    shipped, forced = casts(contextlib.nullcontext()), casts(torch.inference_mode())
    assert forced - shipped >= weights * (steps - 2), (forced, shipped, weights)
