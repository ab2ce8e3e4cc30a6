"""Sampling G completions per prompt: prompts rendered and left-padded, completions masked at EOS.

``generate_rollouts`` samples with the shared-prefix decoder (``grpo_core.rollout.decode``) for the
Llama/Qwen2-style decoders it mirrors exactly, and with transformers' ``generate`` otherwise.
Scoring the sampled tokens (log-probs for the loss) is ``grpo_core.policy.scoring``.
"""
from __future__ import annotations

import torch
from transformers import GenerationConfig

from grpo_core.rollout import decode
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.loops import LoopRule


def chat_messages(question: str, system_prompt: str | None = None) -> list[dict]:
    """The chat turns of one prompt: an optional system message, then the raw question.

    ``system_prompt`` None sends no system turn, so a template that inserts its own default
    system message (SmolLM2's "You are a helpful AI assistant named SmolLM, ...") keeps it."""
    user = [{"role": "user", "content": question}]
    return user if system_prompt is None else [{"role": "system", "content": system_prompt}] + user


def render_prompts(tok, prompts: list[str], system_prompt: str | None = None) -> list[str]:
    """Wrap raw questions in the tokenizer's chat template (plain text if it has none). Rollouts,
    in-stage evaluation, the final evaluation and the served pyfunc all render through this rule."""
    if getattr(tok, "chat_template", None):
        return [tok.apply_chat_template(chat_messages(p, system_prompt), tokenize=False,
                                        add_generation_prompt=True) for p in prompts]
    prefix = "" if system_prompt is None else f"{system_prompt}\n"
    return [f"{prefix}{p}\n" for p in prompts]


def encode_prompts(tok, prompts: list[str], max_prompt_tokens: int, ids: list[str] | None = None,
                   system_prompt: str | None = None):
    """Left-padded ``input_ids, attention_mask`` [N, P]; an over-long prompt is an error."""
    enc = tok(render_prompts(tok, prompts, system_prompt), return_tensors="pt", padding=True,
              add_special_tokens=False)
    lengths = enc["attention_mask"].sum(-1)
    too_long = (lengths > max_prompt_tokens).nonzero().flatten().tolist()
    if too_long:
        i = too_long[0]
        name = ids[i] if ids else f"prompt {i}"
        raise ValueError(f"{name} has {int(lengths[i])} tokens > max_prompt_tokens={max_prompt_tokens}; "
                         "raise max_prompt_tokens (within the model's context) or filter the data")
    return enc["input_ids"], enc["attention_mask"]


def stop_token_ids(model, tok) -> list[int]:
    """The ids that end a completion: the tokenizer's eos first, then any other the checkpoint's
    generation_config lists. Chat models often end a turn with a token other than the
    tokenizer's eos (Llama-3-Instruct's ``<|eot_id|>`` beside ``<|end_of_text|>``; Qwen2.5 lists
    ``<|im_end|>`` and ``<|endoftext|>``); stopping at only one would let every completion run to
    max_new_tokens and show the rewards text past the real end of the answer."""
    ids = [int(tok.eos_token_id)]
    listed = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for i in [listed] if isinstance(listed, int) else list(listed or []):
        if int(i) not in ids:
            ids.append(int(i))
    return ids


def completion_mask(completion_ids: torch.Tensor, eos_id) -> tuple[torch.Tensor, torch.Tensor]:
    """Bool mask of tokens up to and including the first stop token [B, T], and truncated flags
    [B]. ``eos_id``: one id or a list of them (``stop_token_ids``)."""
    is_eos = torch.isin(completion_ids, torch.as_tensor(eos_id, device=completion_ids.device))  # [B, T]
    seen_before = (is_eos.cumsum(-1) - is_eos.long()) > 0                   # an EOS strictly earlier
    return ~seen_before, ~is_eos.any(-1)


def generate_rollouts(model, tok, rows: list[dict], group_size: int, *, temperature: float,
                      top_p: float, top_k: int, max_new_tokens: int, max_prompt_tokens: int,
                      greedy: bool = False, engine: str = "auto", sampler: str = "inverse_cdf",
                      system_prompt: str | None = None, stop_loops: bool = False,
                      sampler_logp: bool = False) -> RolloutBatch:
    """Sample ``group_size`` completions for each row (group-contiguous).

    engine: "auto" (the shared-prefix decoder where ``decode.fast_decode_supported``, else
    generate), "decoder" (insist on it) or "generate". sampler: the decoder's
    (``decode.sample_shared_prefix``). system_prompt: see ``render_prompts``. stop_loops: the
    decoder stops a row once it loops verbatim (``loops.LoopRule``); generate runs such rows to
    the cap (``loops.looped`` flags them either way). sampler_logp: the decoder also returns its
    log-probs of its samples (``RolloutBatch.sampler_logp``, 0 past each completion's end), for an
    engine sampling with a copy of the weights other than the trained ones.
    """
    if engine not in ("auto", "decoder", "generate"):
        raise ValueError(f"engine must be 'auto', 'decoder' or 'generate', got {engine!r}")
    if engine == "decoder" and not decode.fast_decode_supported(model):
        raise ValueError(f"rollout_engine = 'decoder', but the shared-prefix decoder does not support "
                         f"{type(model).__name__}; use rollout_engine = 'auto' or 'generate'")
    prompts = [r["prompt"] for r in rows]
    ids, mask = encode_prompts(tok, prompts, max_prompt_tokens, [r.get("id", "") for r in rows], system_prompt)
    ids, mask = ids.to(model.device), mask.to(model.device)                  # [N, P]
    fast = engine == "decoder" or (engine == "auto" and decode.fast_decode_supported(model))
    if sampler_logp and not fast:
        raise ValueError(f"sampler log-probs come from the shared-prefix decoder, which does not support "
                         f"{type(model).__name__}; sample in fp32 (rollout_precision = 'fp32')")
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    stop = stop_token_ids(model, tok)
    if fast:
        comp = decode.sample_shared_prefix(model, ids, mask, group_size, max_new_tokens=max_new_tokens,
                                           eos_id=stop, pad_id=tok.pad_token_id, sampler=sampler,
                                           loop_rule=LoopRule() if stop_loops else None,
                                           return_logp=sampler_logp, **sampling)
        comp, logp = comp if sampler_logp else (comp, None)
    else:
        comp, logp = _generate(model, ids, mask, group_size, max_new_tokens, stop, tok.pad_token_id, **sampling), None
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [B, P]
    comp = comp.clone()  # [B, T]; a normal tensor again (not an inference tensor), usable by autograd
    cmask, truncated = completion_mask(comp, stop)
    comp = comp.masked_fill(~cmask, tok.pad_token_id)
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
    logp = None if logp is None else logp.masked_fill(~cmask, 0.0).cpu()
    return RolloutBatch(ids.cpu(), mask.cpu(), comp.cpu(), cmask.cpu(), truncated.cpu(), group_size,
                        [p for p in prompts for _ in range(group_size)], texts, columns, sampler_logp=logp)


def _generate(model, ids, mask, group_size, max_new_tokens, eos_id, pad_id, *, temperature, top_p, top_k,
              greedy):
    """transformers' ``generate`` on the prompts repeated G times: completion ids [B, T].

    ``generate`` fills every option we do not pass from the checkpoint's ``generation_config``
    (repetition_penalty, no_repeat_ngram_size, min_new_tokens, suppress_tokens, ...), which would
    sample from a distribution other than the softmax(logits / T) the loss scores. So the call runs
    with a blank generation config holding only pad/eos; the model's own is restored after."""
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [B, P]
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    own = model.generation_config
    model.generation_config = GenerationConfig(pad_token_id=pad_id, eos_token_id=eos_id)
    try:
        with decode.no_grad_for_sampling(ids.device):
            out = model.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy,
                                 max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
                                 use_cache=True, **sampling)
    finally:
        model.generation_config = own
    return out[:, ids.shape[1]:]
