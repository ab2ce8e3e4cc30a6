"""Sampling with a bfloat16 copy of the policy (``sampling.rollout_precision = "bf16"``): the copy
follows the trained weights, decodes as close to the fp32 policy as transformers' own bf16
forward does, reports the log-probs it sampled with, and the trainer corrects the gap."""
import json

import pytest
import torch

from grpo_core.config.checks import ConfigError
from grpo_core.config.stage import GRPOConfig
from grpo_core.rollout import engines
from grpo_core.rollout.decode import sample_shared_prefix
from grpo_core.rollout.generate import completion_mask
from grpo_core.train.entry import main
from tests.helpers import SEVENS, stage_args
from tests.test_fast_rollout import _model, _prompts


def test_the_copy_holds_bf16_parameters_fp32_buffers_and_follows_every_sync():
    model, _ = _model()
    copy = engines.Bf16Copy()
    module = copy.sync(model)
    assert module is not model and not module.training
    assert all(p.dtype == torch.bfloat16 and not p.requires_grad for p in module.parameters())
    assert all(b.dtype == torch.float32 for b in module.buffers())  # rotary frequencies: positions in fp32
    assert module.lm_head.weight is module.model.embed_tokens.weight  # tied weights stay tied
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.25)
    assert copy.sync(model) is module  # refreshed in place, not copied again
    for src, dst in zip(model.parameters(), module.parameters(), strict=True):
        assert src.dtype == torch.float32 and torch.equal(dst, src.detach().to(torch.bfloat16))


def test_the_copy_is_made_again_for_another_module_or_replaced_parameters():
    model, _ = _model()
    copy = engines.Bf16Copy()
    first = copy.sync(model)
    other, _ = _model("qwen2")
    assert copy.sync(other) is not first and copy.module.config.model_type == "qwen2"
    first = copy.sync(model)
    with torch.no_grad():  # a new tensor where the old one was (as resizing an embedding does)
        model.model.norm.weight = torch.nn.Parameter(model.model.norm.weight * 2)
    again = copy.sync(model)
    assert again is not first and torch.equal(again.model.norm.weight, model.model.norm.weight.detach().bfloat16())


model_tok = _model()  # the decoder tests' tiny Llama: weights N(0, 0.3), logits far from uniform


def _step_logits_and_forwards(model, module, G=2, T=12):
    """The bf16 decoder's raw logits at each sampled position, and the fp32 model's and the bf16
    module's full forwards over the same tokens (the positions the decoder predicted)."""
    ids, mask = _prompts(model_tok[1])
    steps = []
    torch.manual_seed(3)
    comp = sample_shared_prefix(module, ids, mask, G, max_new_tokens=T, eos_id=-1, pad_id=model_tok[1].pad_token_id,
                                step_logits=steps, compact_below=0)
    full = torch.cat([ids.repeat_interleave(G, 0), comp], 1)
    fmask = torch.cat([mask.repeat_interleave(G, 0), torch.ones_like(comp)], 1)
    pos = (fmask.cumsum(-1) - 1).clamp(min=0)
    P = ids.shape[1]
    with torch.no_grad():
        fp32 = model(input_ids=full, attention_mask=fmask, position_ids=pos).logits[:, P - 1:-1].float()
        bf16 = module(input_ids=full, attention_mask=fmask, position_ids=pos).logits[:, P - 1:-1].float()
    return torch.stack(steps, 1), fp32, bf16


def test_the_bf16_decoder_is_as_close_to_fp32_as_transformers_bf16_forward():
    model = model_tok[0]
    module = engines.Bf16Copy().sync(model)
    ours, fp32, theirs = _step_logits_and_forwards(model, module)
    ours_err = (ours - fp32).abs().amax(-1).median()
    their_err = (theirs - fp32).abs().amax(-1).median()
    assert ours_err > 1e-3  # it did decode in bf16 (fp32 decoding is within 1e-4 of the forward)
    assert ours_err <= 1.5 * their_err + 1e-3, (ours_err, their_err)


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (0.8, 0, 0.9)])
def test_the_returned_logprobs_are_those_the_loss_scores_rows_finishing_early(temperature, top_k, top_p):
    """log softmax(logits / T) of each sampled token, the distribution the loss scores (top-k/top-p
    filter the sampling only), at the right row while finished rows leave the batch."""
    model, tok = model_tok
    module = engines.Bf16Copy().sync(model)
    ids, mask = _prompts(tok)
    stop = list(range(0, len(tok), 9))  # many stop ids: rows finish early, and the batch compacts
    steps = []
    torch.manual_seed(5)
    comp, logp = sample_shared_prefix(module, ids, mask, 4, max_new_tokens=12, eos_id=stop, pad_id=tok.pad_token_id,
                                      temperature=temperature, top_k=top_k, top_p=top_p, step_logits=steps,
                                      return_logp=True)
    cmask, truncated = completion_mask(comp, stop)
    lengths = cmask.sum(-1)
    assert lengths.min() < lengths.max() and not truncated.all()  # rows of different lengths: compaction ran
    expected = torch.log_softmax(torch.stack(steps, 1) / temperature, -1).gather(-1, comp[..., None])[..., 0]
    assert logp.dtype == torch.float32 and logp.shape == comp.shape
    assert torch.allclose(logp[cmask], expected[cmask], atol=1e-5)
    with pytest.raises(ValueError, match="return_logp is for sampling"):
        sample_shared_prefix(module, ids, mask, 1, max_new_tokens=2, eos_id=0, pad_id=0, greedy=True, return_logp=True)


def test_the_engine_reports_sampler_logprobs_in_bf16_only_and_never_for_greedy():
    model, tok = model_tok
    rows = [{"prompt": "What is 3 + 4?", "gold": "7"}, {"prompt": "7 * 8?", "gold": "56"}]
    bf16 = engines.build("decoder", tok, engines.EngineSpec(rollout_precision="bf16"))
    bf16.sync_weights(model)
    torch.manual_seed(0)
    batch = bf16.generate(rows, 2, engines.Sampling(max_new_tokens=6))
    assert batch.sampler_logp is not None and batch.sampler_logp.shape == batch.completion_ids.shape
    inside = batch.completion_mask
    assert (batch.sampler_logp[~inside] == 0).all() and (batch.sampler_logp[inside] < 0).all()
    greedy = engines.Sampling(max_new_tokens=6, greedy=True)
    bf16_greedy = bf16.generate(rows, 1, greedy)
    assert bf16_greedy.sampler_logp is None
    fp32 = engines.build("decoder", tok)
    fp32.sync_weights(model)
    assert fp32.generate(rows, 2, engines.Sampling(max_new_tokens=6)).sampler_logp is None
    # greedy decoding (the evaluations') uses the policy itself: the fp32 engine's tokens exactly
    assert torch.equal(bf16_greedy.completion_ids, fp32.generate(rows, 1, greedy).completion_ids)
    with pytest.raises(ValueError, match="rollout_engine = 'decoder' or rollout_precision = 'fp32'"):
        engines.build("generate", tok, engines.EngineSpec(rollout_precision="bf16"))


def test_sampling_decodes_with_the_copy_and_greedy_with_the_policy(monkeypatch):
    """What each kind of call hands the decoder: the copy (bf16) when sampling, the policy itself
    (the trained fp32 module) when greedy."""
    from grpo_core.rollout import generate

    model, tok = model_tok
    seen, real = [], generate.generate_rollouts
    monkeypatch.setattr(generate, "generate_rollouts", lambda m, *a, **kw: seen.append((m, kw)) or real(m, *a, **kw))
    engine = engines.build("decoder", tok, engines.EngineSpec(rollout_precision="bf16"))
    engine.sync_weights(model)
    rows = [{"prompt": "7 * 8?", "gold": "56"}]
    engine.generate(rows, 2, engines.Sampling(max_new_tokens=3))
    engine.generate(rows, 1, engines.Sampling(max_new_tokens=3, greedy=True))
    (sampler, sampled_kw), (greedy_model, greedy_kw) = seen
    assert sampler is engine.copy.module and next(sampler.parameters()).dtype == torch.bfloat16
    assert sampled_kw["sampler_logp"] and not greedy_kw["sampler_logp"]
    assert greedy_model is model


def test_a_lora_policy_is_copied_with_its_adapters_and_stays_close():
    """LoRA adapters (peft, injected in place) travel in the copy: the decoder merges them in bf16
    and its logits stay as close to the fp32 adapted policy as transformers' bf16 forward's."""
    from grpo_core.config.groups import LoraSettings
    from grpo_core.model import lora

    model, _ = _model()
    lora.attach(model, LoraSettings(rank=4, alpha=8.0), "stage")
    with torch.no_grad():  # adapters that change the output (peft starts lora_B at zero)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)
    module = engines.Bf16Copy().sync(model)
    assert any("lora_A" in n for n, _ in module.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in module.parameters())
    ours, fp32, theirs = _step_logits_and_forwards(model.eval(), module)
    ours_err = (ours - fp32).abs().amax(-1).median()
    assert 1e-3 < ours_err <= 1.5 * (theirs - fp32).abs().amax(-1).median() + 1e-3


def test_a_model_the_decoder_does_not_support_is_refused_naming_the_fix():
    from transformers import GPT2Config, GPT2LMHeadModel

    tok = model_tok[1]
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=64,
                                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    engine = engines.build("auto", tok, engines.EngineSpec(rollout_precision="bf16"))
    with pytest.raises(ValueError, match=r"rollout_precision = 'bf16'.*GPT2LMHeadModel.*rollout_precision = 'fp32'"):
        engine.sync_weights(gpt2)  # before any rollout


@pytest.mark.parametrize("fields, match", [
    (dict(sampling=dict(rollout_precision="fp16")), r"sampling\.rollout_precision.*'fp16'.*fp32.*bf16"),
    (dict(sampling=dict(rollout_precision="bf16", rollout_engine="generate")),
     r"sampling\.rollout_precision.*'generate' does not use:.*rollout_engine = 'decoder'"),
    (dict(sampling=dict(rollout_precision="bf16", rollout_engine="vllm")), r"sampling\.rollout_precision.*'vllm'"),
    (dict(sampling=dict(rollout_precision="bf16"), execution=dict(precision="bf16")),
     r"sampling\.rollout_precision.*execution\.precision = 'bf16'"),
    (dict(sampling=dict(rollout_precision="bf16"), execution=dict(parallelism="fsdp2")),
     r"sampling\.rollout_precision.*fsdp2.*not supported"),
    (dict(sampling=dict(rollout_precision="bf16")), r"loss\.rollout_is.*'sequence_mask'.*learnt less.*'none'"),
    (dict(sampling=dict(rollout_precision="bf16"), loss=dict(rollout_is="sequence_truncate")),
     r"loss\.rollout_is.*'sequence_truncate'.*rollout_is = 'none'"),
    (dict(sampling=dict(rollout_precision="bf16"), loss=dict(rollout_is="none"), lora=dict(rank=4, dropout=0.1),
          disable_dropout=False),
     r"sampling\.rollout_precision.*no adapter dropout.*lora\.dropout = 0"),
])
def test_bad_combinations_are_refused_naming_the_field_and_the_fix(fields, match):
    with pytest.raises(ConfigError, match=match):
        GRPOConfig(runtime=dict(model="m", output_dir="o"), **fields)


def test_the_objective_card_names_the_correction_a_bf16_copy_gets():
    from grpo_core.algo.objective import objective_card

    cfg = GRPOConfig(runtime=dict(model="m", output_dir="o"), sampling=dict(rollout_precision="bf16"),
                     loss=dict(rollout_is="token_truncate"))
    line = objective_card(cfg, 1)["rollout_correction"]
    assert line.startswith("token_truncate: r = exp(old_logp - sampler_logp) per token")
    assert line.endswith("(sampler: a bf16 copy of the policy)")


def test_a_stage_sampling_in_bf16_trains_and_logs_the_gap_it_corrects(tiny, tmp_path):
    main(stage_args(runtime=dict(model=str(tiny), output_dir=str(tmp_path)), rewards=SEVENS, iterations=2,
                    prompts_per_iter=3, sampling=dict(group_size=4, max_new_tokens=8, rollout_precision="bf16"),
                    loss=dict(rollout_is="token_truncate"),
                    checkpoint=dict(every=2)))
    rows = [json.loads(ln) for ln in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 2
    for m in rows:
        assert 1e-4 < m["rollout_logp_gap_mean"] < 0.5, m  # bf16 rounding (fp32: < 1e-5), not other weights
        assert m["rollout_is_ratio_min"] <= 1 <= m["rollout_is_ratio_max"]
