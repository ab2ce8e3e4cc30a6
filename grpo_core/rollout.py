"""Sampling completions and scoring their tokens, with the same positions in both.

``generate_rollouts`` samples G completions per prompt with transformers' ``generate`` (KV
cache, left padding, stop at EOS). ``completion_logprobs`` re-scores those tokens with a
forward pass that passes the *same* position ids ``generate`` used (``cumsum(mask) - 1``):
without them a left-padded batch is scored at shifted positions and the on-policy gradient
silently becomes off-policy. Log-probs are taken at the sampling temperature, and only the
completion positions' logits are computed (``logits_to_keep``), never a [B, P+T, V] tensor.
"""
from __future__ import annotations

import torch

from grpo_core.algorithm import token_entropy, token_logprobs
from grpo_core.types import RolloutBatch


def render_prompts(tok, prompts: list[str]) -> list[str]:
    """Wrap raw questions in the tokenizer's chat template (plain text if it has none)."""
    if getattr(tok, "chat_template", None):
        return [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                        add_generation_prompt=True) for p in prompts]
    return [f"{p}\n" for p in prompts]


def encode_prompts(tok, prompts: list[str], max_prompt_tokens: int, ids: list[str] | None = None):
    """Left-padded ``input_ids, attention_mask`` [N, P]; an over-long prompt is an error."""
    enc = tok(render_prompts(tok, prompts), return_tensors="pt", padding=True, add_special_tokens=False)
    lengths = enc["attention_mask"].sum(-1)
    too_long = (lengths > max_prompt_tokens).nonzero().flatten().tolist()
    if too_long:
        i = too_long[0]
        name = ids[i] if ids else f"prompt {i}"
        raise ValueError(f"{name} has {int(lengths[i])} tokens > max_prompt_tokens={max_prompt_tokens}; "
                         "raise max_prompt_tokens (within the model's context) or filter the data")
    return enc["input_ids"], enc["attention_mask"]


def completion_mask(completion_ids: torch.Tensor, eos_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool mask of tokens up to and including the first EOS [B, T], and truncated flags [B]."""
    is_eos = completion_ids == eos_id                                       # [B, T]
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0                   # an EOS strictly earlier
    return ~seen_before, ~is_eos.any(-1)


def generate_rollouts(model, tok, rows: list[dict], group_size: int, *, temperature: float,
                      top_p: float, top_k: int, max_new_tokens: int, max_prompt_tokens: int,
                      greedy: bool = False) -> RolloutBatch:
    """Sample ``group_size`` completions for each row (group-contiguous)."""
    prompts = [r["prompt"] for r in rows]
    ids, mask = encode_prompts(tok, prompts, max_prompt_tokens, [r.get("id", "") for r in rows])
    ids = ids.repeat_interleave(group_size, 0).to(model.device)              # [B, P]
    mask = mask.repeat_interleave(group_size, 0).to(model.device)            # [B, P]
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy,
                             max_new_tokens=max_new_tokens, pad_token_id=tok.pad_token_id,
                             eos_token_id=tok.eos_token_id, use_cache=True, **sampling)
    comp = out[:, ids.shape[1]:].clone()  # [B, T]; a normal tensor again, usable by autograd
    cmask, truncated = completion_mask(comp, tok.eos_token_id)
    comp = comp.masked_fill(~cmask, tok.pad_token_id)
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
    return RolloutBatch(ids.cpu(), mask.cpu(), comp.cpu(), cmask.cpu(), truncated.cpu(), group_size,
                        [p for p in prompts for _ in range(group_size)], texts, columns)


def _forward_inputs(batch: RolloutBatch, device):
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)            # [B, P+T]
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).to(device)  # [B, P+T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                           # as generate does
    return ids, attn, pos


def completion_logprobs(model, batch: RolloutBatch, temperature: float, with_entropy: bool = False):
    """Per-token log-probs of the completion tokens [B, T] (and entropy [B, T] if asked)."""
    device = next(model.parameters()).device
    ids, attn, pos = _forward_inputs(batch, device)
    T = batch.completion_ids.shape[1]
    logits = model(input_ids=ids, attention_mask=attn, position_ids=pos,
                   logits_to_keep=T + 1, use_cache=False).logits[:, :-1]        # [B, T, V]
    targets = batch.completion_ids.to(device)
    logp = token_logprobs(logits, targets, temperature)                         # [B, T]
    if not with_entropy:
        return logp, None
    with torch.no_grad():
        ent = token_entropy(logits.detach(), temperature)                       # [B, T]
    return logp, ent
