"""Rollouts: the training forward scores exactly the distribution generate sampled from."""
import pytest
import torch

from grpo_core.model.loading import build_tiny
from grpo_core.policy.scoring import completion_logprobs, forward_inputs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.generate import completion_mask, encode_prompts, generate_rollouts, stop_token_ids

ROWS = [{"id": "a", "prompt": "What is 3 + 4?", "gold": "7"},
        {"id": "b", "prompt": "A much longer question so the batch is left padded: 12 * 11?", "gold": "132"}]


def _model(arch="llama"):
    torch.manual_seed(0)
    model, tok = build_tiny(hidden=32, layers=2, heads=2)
    if arch == "gpt2":  # absolute position embeddings: a position shift changes the logits
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=2, n_head=2,
                                           n_positions=256, pad_token_id=tok.pad_token_id,
                                           eos_token_id=tok.eos_token_id))
    with torch.no_grad():  # large random weights: positions matter visibly (init std 0.02 hides them)
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval(), tok


def _generate_with_logits(model, tok, temperature=0.7, G=3):
    ids, mask = encode_prompts(tok, [r["prompt"] for r in ROWS], 256)
    ids, mask = ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0)
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=True, temperature=temperature,
                         top_k=0, top_p=1.0, max_new_tokens=12, pad_token_id=tok.pad_token_id,
                         eos_token_id=tok.eos_token_id, output_logits=True, return_dict_in_generate=True)
    comp = out.sequences[:, ids.shape[1]:]
    cmask, trunc = completion_mask(comp, tok.eos_token_id)
    batch = RolloutBatch(ids, mask, comp.masked_fill(~cmask, tok.pad_token_id), cmask, trunc, G,
                         [], [])
    return batch, torch.stack(out.logits, 1)                                        # [B, T, V]


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_training_logprobs_match_generate_scores_under_left_padding(arch):
    model, tok = _model(arch)
    batch, step_logits = _generate_with_logits(model, tok)
    assert (batch.prompt_mask == 0).any(), "the batch must be left padded for this test to mean anything"
    ref = torch.log_softmax(step_logits / 0.7, -1).gather(-1, batch.completion_ids.unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, temperature=0.7)
    m = batch.completion_mask
    assert m.sum() > 10
    assert torch.allclose(logp[m], ref[m], atol=1e-4)


def test_arange_positions_would_score_a_different_distribution():
    """Negative control: without generate's position ids the padded rows are scored wrongly.

    Shown on GPT-2 (absolute positions). RoPE models (Llama, Qwen2) depend only on relative
    positions, so for them the shift is invisible up to rounding; we pass the ids regardless.
    """
    model, tok = _model("gpt2")
    batch, _ = _generate_with_logits(model, tok)
    ids, attn, pos = forward_inputs(batch, "cpu")
    T = batch.completion_ids.shape[1]
    with torch.no_grad():
        good = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits[:, -T - 1:-1]
        bad = model(input_ids=ids, attention_mask=attn).logits[:, -T - 1:-1]
    padded = batch.prompt_mask.eq(0).any(-1)
    assert not torch.allclose(good[padded], bad[padded], atol=1e-3)


def test_completion_mask_stops_after_first_eos_and_flags_truncation():
    eos = 1
    comp = torch.tensor([[5, 6, eos, 0, 0], [5, 6, 7, 8, 9], [eos, 3, eos, 0, 0]])
    mask, truncated = completion_mask(comp, eos)
    assert mask.tolist() == [[True, True, True, False, False], [True] * 5, [True, False, False, False, False]]
    assert truncated.tolist() == [False, True, False]


def test_completion_mask_stops_at_any_of_several_stop_ids():
    comp = torch.tensor([[5, 2, 7, 0], [5, 6, 1, 0], [5, 6, 7, 8]])
    mask, truncated = completion_mask(comp, [1, 2])
    assert mask.tolist() == [[True, True, False, False], [True, True, True, False], [True] * 4]
    assert truncated.tolist() == [False, False, True]


def test_stop_token_ids_add_the_checkpoints_other_eos_ids():
    model, tok = _model()
    eos = tok.eos_token_id
    for listed, want in ((None, [eos]), (eos, [eos]), (7, [eos, 7]), ([7, eos, 9], [eos, 7, 9])):
        model.generation_config.eos_token_id = listed
        assert stop_token_ids(model, tok) == want, listed


@pytest.mark.parametrize("engine", ["decoder", "generate"])
def test_rollouts_stop_at_a_turn_end_token_the_generation_config_lists(engine):
    """A chat checkpoint whose turns end with a token other than the tokenizer's eos (listed in
    its generation_config, as Llama-3-Instruct's <|eot_id|>): sampling, the completion mask and
    the text all stop there, on the decoder and on the generate fallback alike."""
    model, tok = _model()
    greedy = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=8, max_prompt_tokens=256,
                  greedy=True, engine=engine)
    free = generate_rollouts(model, tok, ROWS[:1], 1, **greedy)
    assert free.truncated.all()  # this prompt runs to max_new_tokens without a stop
    turn_end = int(free.completion_ids[0, 2])  # the third token it emits becomes a stop id
    assert turn_end not in free.completion_ids[0, :2].tolist()
    model.generation_config.eos_token_id = [tok.eos_token_id, turn_end]
    stopped = generate_rollouts(model, tok, ROWS[:1], 1, **greedy)
    assert stopped.completion_mask.sum().item() == 3 and not stopped.truncated.any()
    assert stopped.completion_ids[0, :3].tolist() == free.completion_ids[0, :3].tolist()
    assert free.completions[0].startswith(stopped.completions[0])
    assert len(stopped.completions[0]) < len(free.completions[0])


def test_rollout_batch_is_group_contiguous_with_columns():
    model, tok = _model()
    batch = generate_rollouts(model, tok, ROWS, 3, temperature=1.0, top_p=1.0, top_k=0,
                              max_new_tokens=8, max_prompt_tokens=256)
    assert len(batch) == 6 and batch.group_size == 3
    assert batch.columns["gold"] == ["7"] * 3 + ["132"] * 3
    assert batch.prompts[3] == ROWS[1]["prompt"]
    texts = tok.batch_decode(batch.completion_ids, skip_special_tokens=True)
    assert texts == batch.completions


def test_overlong_prompt_is_an_error_naming_the_row():
    _, tok = _model()
    with pytest.raises(ValueError, match="b has .* max_prompt_tokens=40"):
        encode_prompts(tok, [r["prompt"] for r in ROWS], 40, ids=[r["id"] for r in ROWS])
