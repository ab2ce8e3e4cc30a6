"""LoRA policies (peft): the reference is the policy with adapters off, only adapters train, the
merged final model is a plain HF dir with the same log-probs, the decoder mirrors the adapters,
checkpoints hold the adapters and resume bitwise, and 2 DDP ranks equal one process."""
import json

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stage import GRPOConfig
from grpo_core.model import lora
from grpo_core.model.loading import load_policy, save_policy
from grpo_core.policy.scoring import completion_logprobs
from grpo_core.rollout.decode import fast_decode_supported, sample_shared_prefix
from grpo_core.rollout.generate import _generate, encode_prompts
from grpo_core.train.entry import load_config, main
from grpo_core.train.trainer import Trainer
from tests.faults import InjectedFault, crash_after_iteration
from tests.helpers import fixed_rollout_batch, same_weights
from tests.trainer_helpers import ddp_update, in_process_trainer, trainer_stage

LORA = {"rank": 4, "alpha": 8.0}


def _trainer(tiny, out, **kw) -> Trainer:
    """One update per ``update()`` call (mu = 1), as the tests below count steps."""
    base = dict(optim=dict(lr=1e-2, max_grad_norm=0.0, mu=1), prompts_per_iter=2, sampling=dict(max_new_tokens=7),
                lora=LORA)
    return in_process_trainer(tiny, out, **deep_merge(base, kw))


def _logp(model, batch) -> torch.Tensor:
    return completion_logprobs(model, batch, 1.0)[0]


def _step(trainer) -> dict:
    batch = fixed_rollout_batch(2)
    batch.advantages = trainer.advantages(batch.rewards)
    return trainer.update(batch)


def test_at_step_zero_the_lora_policy_is_the_reference_and_kl_is_exactly_zero(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path)
    assert trainer.policy.ref is None  # no second copy of the weights
    batch = fixed_rollout_batch(2)
    with torch.no_grad():
        policy = _logp(trainer.policy.model, batch)
        with lora.reference_mode(trainer.policy.lora):
            reference = _logp(trainer.policy.model, batch)
    assert torch.equal(policy, reference)
    stats = _step(trainer)
    assert stats["kl"] == 0.0
    assert stats["grad_norm"] > 0  # lora_B's gradient: the adapters do learn from step 0


def test_a_lora_update_changes_only_adapter_parameters(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path)
    trained, total = lora.adapter_count(trainer.policy.model)
    assert 0 < trained < total / 5
    assert sum(p.numel() for g in trainer.opt.param_groups for p in g["params"]) == trained
    before = {n: p.detach().clone() for n, p in trainer.policy.model.named_parameters()}
    _step(trainer)
    _step(trainer)  # the second step moves lora_A too (its gradient is 0 while lora_B is 0)
    after = dict(trainer.policy.model.named_parameters())
    changed = {n for n in before if not torch.equal(before[n], after[n])}
    adapters = {n for n, p in after.items() if p.requires_grad}
    assert changed == adapters and all("lora_" in n for n in adapters)
    assert all(not p.requires_grad for n, p in after.items() if "lora_" not in n)
    with torch.no_grad(), lora.reference_mode(trainer.policy.lora):  # the reference is still the start model
        start, _ = load_policy(str(tiny))
        batch = fixed_rollout_batch(2)
        assert torch.equal(_logp(trainer.policy.model, batch), _logp(start, batch))


def test_the_merged_model_is_a_plain_hf_dir_with_the_policys_logprobs(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path / "run")
    for _ in range(3):
        _step(trainer)
    batch = fixed_rollout_batch(2)
    with torch.no_grad():
        unmerged = _logp(trainer.policy.model, batch)
        with lora.reference_mode(trainer.policy.lora):
            reference = _logp(trainer.policy.model, batch)
    assert (unmerged - reference).abs().max() > 1e-3  # the adapters did change the policy
    final = save_policy(lora.merged(trainer.policy.lora), trainer.policy.tok, tmp_path / "final")
    weights = load_file(str(final / "model.safetensors"))
    assert not any("lora_" in k or "base_layer" in k for k in weights)
    assert not (final / "adapter_config.json").exists()
    plain, _ = load_policy(str(final))
    assert all(type(m).__module__.startswith(("torch", "transformers")) for m in plain.modules())
    with torch.no_grad():
        merged = _logp(plain, batch)
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=0)


def test_the_shared_prefix_decoder_samples_from_the_adapted_policy(tiny, tmp_path):
    """Greedy tokens of the decoder (base weight + adapter delta) equal generate's (peft's forward)."""
    trainer = _trainer(tiny, tmp_path)
    with torch.no_grad():
        for n, p in trainer.policy.model.named_parameters():
            if "lora_" in n:
                p.normal_(0, 0.5)  # adapters large enough to change the greedy tokens
    model, tok = trainer.policy.model.eval(), trainer.policy.tok
    assert fast_decode_supported(model)
    ids, mask = encode_prompts(tok, ["7 + 7 =", "a longer prompt, 12 * 3 ="], 64)
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    ref = _generate(model, ids, mask, 2, 12, tok.eos_token_id, tok.pad_token_id, **kw)
    fast = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=12, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id, greedy=True)
    assert torch.equal(fast, ref)
    with lora.reference_mode(trainer.policy.lora):
        base = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=12, eos_id=tok.eos_token_id,
                                    pad_id=tok.pad_token_id, greedy=True)
    assert not torch.equal(base, fast), "the adapters must change what the decoder samples"


def test_adapter_dropout_while_training_falls_back_to_generate(tiny, tmp_path):
    trainer = _trainer(tiny, tmp_path, disable_dropout=False, lora={**LORA, "dropout": 0.1})
    assert not fast_decode_supported(trainer.policy.model.train())
    assert fast_decode_supported(trainer.policy.model.eval())


def _stage(tiny, out, **kw):
    return trainer_stage(tiny, out, **deep_merge({"optim": {"lr": 3e-2}, "lora": LORA}, kw))


def test_lora_checkpoints_hold_the_adapters_and_resume_bitwise(tiny, tmp_path):
    main(_stage(tiny, tmp_path / "straight"))
    with crash_after_iteration(5), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "crashed"))
    saved = load_file(str(tmp_path / "crashed" / "checkpoints" / "ckpt-000004" / "model.safetensors"))
    assert saved and all("lora_" in k for k in saved)
    summary = main(_stage(tiny, tmp_path / "crashed"))
    assert summary["resumed_from_iteration"] == 4 and summary["iterations_run"] == 6
    assert same_weights(tmp_path / "straight" / "final", tmp_path / "crashed" / "final")
    rows = [json.loads(ln) for ln in (tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["kl"] > 0  # the policy moved away from the reference (adapters off)
    card = json.loads((tmp_path / "straight" / "objective.json").read_text())
    assert card["reference"] == "the policy with its LoRA adapters off"
    assert card["trained_weights"].startswith("LoRA adapters: rank 4, alpha 8 (scale 2)")


def test_a_full_fine_tuning_checkpoint_is_refused_by_a_lora_stage(tiny, tmp_path):
    with crash_after_iteration(3), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "run", lora={"rank": 0}))
    with pytest.raises(ValueError, match="other lora settings or another model"):
        main(_stage(tiny, tmp_path / "run"))


def test_two_ddp_ranks_equal_one_process_with_lora(tiny, tmp_path):
    one, _ = ddp_update(tiny, tmp_path / "one.st", 1, "dapo", lora=LORA)
    two, _ = ddp_update(tiny, tmp_path / "two.st", 2, "dapo", lora=LORA)
    assert one.keys() == two.keys() and one and all("lora_" in k for k in one)
    for k in one:
        assert torch.allclose(one[k], two[k], atol=1e-7, rtol=1e-4), k


@pytest.mark.parametrize("lora_fields,match", [
    ({"rank": -1}, r"stage 'grpo'\.lora\.rank: must be >= 0"),
    ({"rank": 4, "alpha": 0}, r"stage 'grpo'\.lora\.alpha: must be > 0"),
    ({"rank": 4, "dropout": 0.1}, r"stage 'grpo'\.lora\.dropout: 0\.1 would be zeroed by disable_dropout"),
    ({"rank": 4, "target_modules": []}, r"stage 'grpo'\.lora\.target_modules: \[\]"),
    ({"rank": 4, "ranks": 8}, r"unknown field stage\.lora\.ranks\. Did you mean 'rank'\?"),
])
def test_bad_lora_settings_name_the_field(lora_fields, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [f"lora={json.dumps(lora_fields)}"])


def test_target_modules_that_match_nothing_name_the_field(tiny, tmp_path):
    with pytest.raises(ConfigError, match=r"stage 'grpo'\.lora\.target_modules = \['attn'\]: .*not found"):
        _trainer(tiny, tmp_path, lora={"rank": 4, "target_modules": ["attn"]})


def test_the_default_is_full_fine_tuning():
    assert GRPOConfig().lora.rank == 0
