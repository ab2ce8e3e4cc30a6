"""Sampling completions and scoring their tokens, with the same positions in both.

``generate_rollouts`` samples G completions per prompt (KV cache, left padding, stop at EOS).
For Llama/Qwen2-style decoders on SDPA it uses ``sample_shared_prefix``: each prompt is prefilled
once and its KV cache is copied G times into a preallocated buffer, then a lean loop over the
model's own layers samples from softmax(logits / T) (top-k / top-p via transformers' warpers) by
inverting the CDF, stopping when every sequence has emitted EOS. It gives exactly ``generate``'s
tokens under greedy decoding, and under sampling with ``sampler="multinomial"`` and the same seed
(tests/test_fast_rollout.py); other models use ``generate``. ``completion_logprobs`` re-scores the
tokens with the *same* position ids (``cumsum(mask) - 1``): without them a left-padded batch is
scored at shifted positions and the on-policy gradient silently becomes off-policy. When the G
rows of every group share one prompt, the prompt is run once per group and its (differentiable) KV
cache is shared by the G completions, and rows are scored in length-sorted chunks that stop at each
chunk's longest completion, so positions after EOS cost (almost) nothing.
Log-probs are taken at the sampling temperature, and only the completion positions' logits are
computed, never a [B, P+T, V] tensor.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from grpo_core.algorithm import token_entropy, token_logprobs
from grpo_core.config import SAMPLERS
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
                      greedy: bool = False, engine: str = "auto", sampler: str = "inverse_cdf") -> RolloutBatch:
    """Sample ``group_size`` completions for each row (group-contiguous).

    engine: "auto" (the shared-prefix decoder where ``fast_decode_supported``, else generate),
    "fast" (insist on it) or "generate". sampler: the decoder's (``sample_shared_prefix``).
    """
    if engine not in ("auto", "fast", "generate"):
        raise ValueError(f"engine must be 'auto', 'fast' or 'generate', got {engine!r}")
    prompts = [r["prompt"] for r in rows]
    ids, mask = encode_prompts(tok, prompts, max_prompt_tokens, [r.get("id", "") for r in rows])
    ids, mask = ids.to(model.device), mask.to(model.device)                  # [N, P]
    fast = engine == "fast" or (engine == "auto" and fast_decode_supported(model))
    sampling = dict(temperature=temperature, top_p=top_p, top_k=top_k, greedy=greedy)
    if fast:
        comp = sample_shared_prefix(model, ids, mask, group_size, max_new_tokens=max_new_tokens,
                                    eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, sampler=sampler, **sampling)
    else:
        comp = _generate(model, ids, mask, group_size, max_new_tokens, tok.eos_token_id, tok.pad_token_id,
                         **sampling)
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [B, P]
    comp = comp.clone()  # [B, T]; a normal tensor again (not an inference tensor), usable by autograd
    cmask, truncated = completion_mask(comp, tok.eos_token_id)
    comp = comp.masked_fill(~cmask, tok.pad_token_id)
    texts = tok.batch_decode(comp, skip_special_tokens=True)
    columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
    return RolloutBatch(ids.cpu(), mask.cpu(), comp.cpu(), cmask.cpu(), truncated.cpu(), group_size,
                        [p for p in prompts for _ in range(group_size)], texts, columns)


def _generate(model, ids, mask, group_size, max_new_tokens, eos_id, pad_id, *, temperature, top_p, top_k,
              greedy):
    """transformers' ``generate`` on the prompts repeated G times: completion ids [B, T]."""
    ids, mask = ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0)  # [B, P]
    sampling = {} if greedy else {"temperature": temperature, "top_p": top_p, "top_k": top_k}
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=not greedy,
                             max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=eos_id,
                             use_cache=True, repetition_penalty=1.0,  # checkpoint defaults would
                             **sampling)                             # skew what the loss scores
    return out[:, ids.shape[1]:]


# ----------------------------------------------------------------------------- shared-prefix decoding

FAST_DECODE_MODEL_TYPES = ("llama", "qwen2")  # pre-norm RMSNorm, rotary, q/k/v/o attention, SiLU-gated MLP


def fast_decode_supported(model) -> bool:
    """Whether ``sample_shared_prefix`` mirrors this model's layers exactly (else use generate)."""
    cfg, inner = getattr(model, "config", None), getattr(model, "model", None)
    if cfg is None or inner is None or getattr(cfg, "model_type", None) not in FAST_DECODE_MODEL_TYPES:
        return False
    if getattr(cfg, "_attn_implementation", None) != "sdpa" or getattr(cfg, "use_sliding_window", False):
        return False
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return False
    if model.training and getattr(cfg, "attention_dropout", 0.0):  # generate would drop attention weights
        return False
    try:
        layer = inner.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        return (getattr(cfg, "hidden_act", None) == "silu" and hasattr(inner, "rotary_emb")
                and all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj", "scaling", "head_dim"))
                and not hasattr(attn, "q_norm") and all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj"))
                and all(hasattr(m, "variance_epsilon") for m in (layer.input_layernorm, inner.norm)))
    except (AttributeError, IndexError, TypeError):  # wrapped or unusual models: use generate
        return False


def _cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; accept either (looked up once
    per forward function: ``inspect.signature`` costs ~0.15 ms, and scoring calls the model ~8 times a step)."""
    forward = model.forward
    return _forward_cache_kwarg(getattr(forward, "__func__", forward))  # the function, not a fresh bound method


@functools.lru_cache(maxsize=64)
def _forward_cache_kwarg(forward) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _prefill(model, ids, mask, logits_to_keep: int = 1):
    """Run left-padded prompts [N, P] with generate's position ids; returns (output, DynamicCache)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                logits_to_keep=logits_to_keep, **{_cache_kwarg(model): cache})
    return out, cache


def _warp(logits, temperature: float, top_k: int, top_p: float):
    """The warpers generate applies when sampling, in generate's order: temperature, top-k, top-p."""
    from transformers.generation.logits_process import (TemperatureLogitsWarper, TopKLogitsWarper,
                                                        TopPLogitsWarper)
    if temperature != 1.0:
        logits = TemperatureLogitsWarper(temperature)(None, logits)
    if top_k:
        logits = TopKLogitsWarper(top_k=top_k)(None, logits)
    if top_p < 1.0:
        logits = TopPLogitsWarper(top_p=top_p)(None, logits)
    return logits


def sample_inverse_cdf(probs):
    """One token per row of ``probs`` [b, V] (rows need not sum to 1), by inverting the CDF.

    The first index whose float64 cumulative sum exceeds u * total, u ~ U[0, 1): a token of zero
    probability is never chosen (its cumulative sum equals its predecessor's), and u * total < total
    in float64, so the index stays in range (the clamp is a guard only). A row that is not a
    distribution (NaN, inf, all zero: a diverged policy) is an error, as in ``torch.multinomial``.
    """
    cdf = torch.cumsum(probs, -1, dtype=torch.float64)                           # [b, V]
    total = cdf[:, -1:]                                                          # [b, 1]
    ok = total.isfinite() & (total > 0)
    if not bool(ok.all()):  # one sync a step, as the loop's EOS check
        bad = int((~ok).nonzero()[0, 0])
        raise ValueError(f"sampling probabilities of row {bad} are not a distribution (sum {total[bad, 0].item()}): "
                         "the policy's logits are NaN/inf; lower lr or check the last checkpoint")
    u = torch.rand(probs.shape[0], 1, dtype=torch.float64, device=probs.device) * total
    return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[-1] - 1)  # [b]


def _rms_norm(x, weight, eps: float):
    """transformers' Llama/Qwen2 RMSNorm (float32 statistics, weight applied last) in one fused op;
    ``F.rms_norm`` is bitwise equal to its x * rsqrt(mean(x^2) + eps) on CPU."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _single_query_attention(q, keys_t, values, bias, scale: float):
    """softmax(q K^T * scale + bias) V for one new token per row: two batched GEMVs.

    q [b, rep, D], keys_t [b, D, L] (keys stored transposed: the GEMV reads them in order),
    values [b, L, D], bias [b, 1, L] (0, or -inf at prompt padding); b = rows x KV heads.
    SDPA's CPU flash kernel is built for many queries; with one query per row it cost ~0.7 ms
    per call here (a quarter of decoding). Same math; the values differ from SDPA's only by
    summation order (~1e-7).
    """
    scores = torch.baddbmm(bias, q, keys_t, alpha=scale)                      # [b, rep, L]
    return torch.bmm(torch.softmax(scores, dim=-1), values)                   # [b, rep, D]


def _signed_sin(sin):
    """sin [..., D] with its first half negated: rotate_half(x) * sin == roll(x, D/2) * _signed_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], -1)


class _Stepper:
    """Decode state of B rows and one step through the model's own weights and ops, minus the
    module-call overhead.

    K/V live in preallocated buffers of P + T slots per row: keys transposed [B, nkv, D, P+T],
    values [B, nkv, P+T, D]. Step t writes slot P + t and attends over slots [0, P + t] only
    (unwritten slots are never read, so the buffers need no clearing), with an additive bias
    [B, nkv, 1, P+T] that is -inf at left padding, written once. With the default rotary
    embedding, cos/sin of every row's T positions are computed once [B, T, D]; scaled variants
    (whose frequencies may depend on the positions seen) get the model's own cos/sin each step.
    """

    def __init__(self, model, cache, mask, group_size: int, max_new_tokens: int):
        """cache: the prefill's DynamicCache of the N prompts [N, nkv, P, D]; mask [N, P]."""
        self.model, self.inner = model, model.model
        attn = self.inner.layers[0].self_attn
        lin = lambda m: (m.weight, m.bias)  # noqa: E731
        self.layers = [(l.input_layernorm.weight, l.input_layernorm.variance_epsilon,
                        lin(l.self_attn.q_proj), lin(l.self_attn.k_proj), lin(l.self_attn.v_proj),
                        lin(l.self_attn.o_proj), l.post_attention_layernorm.weight,
                        l.post_attention_layernorm.variance_epsilon,
                        lin(l.mlp.gate_proj), lin(l.mlp.up_proj), lin(l.mlp.down_proj)) for l in self.inner.layers]
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        G, T, (N, P) = group_size, max_new_tokens, mask.shape
        B, self.P = N * G, P
        self.keys, self.values = [], []
        for layer in cache.layers:
            k, v = layer.keys, layer.values                                  # [N, nkv, P, D]
            self.keys.append(k.new_empty(B, k.shape[1], k.shape[-1], P + T))   # [B, nkv, D, P+T]
            self.keys[-1][..., :P] = k.transpose(-1, -2).repeat_interleave(G, 0)
            self.values.append(v.new_empty(B, v.shape[1], P + T, v.shape[-1]))  # [B, nkv, P+T, D]
            self.values[-1][:, :, :P] = v.repeat_interleave(G, 0)
        nkv = self.keys[0].shape[1]
        self.bias = self.keys[0].new_zeros(B, nkv, 1, P + T)                   # [B, nkv, 1, P+T]
        self.bias[..., :P].masked_fill_(~mask.bool().repeat_interleave(G, 0)[:, None, None], float("-inf"))
        last = mask.sum(-1).repeat_interleave(G)[:, None] - 1                  # [B, 1] last prompt position
        self.positions = last + torch.arange(1, T + 1, device=last.device)     # [B, T] of the new tokens
        self.rotations = None
        if getattr(self.inner.rotary_emb, "rope_type", "default") == "default":
            self.rotations = self._cos_sin(self.positions)                     # [B, T, D] each

    def _cos_sin(self, positions):
        """cos and sign-flipped sin [B, S, D] at ``positions`` [B, S], from the model's rotary module."""
        cos, sin = self.inner.rotary_emb(self.keys[0], positions)
        return cos, _signed_sin(sin)

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` [b] (finished ones) from the state."""
        self.keys, self.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        self.bias, self.positions = self.bias[rows], self.positions[rows]
        if self.rotations is not None:
            self.rotations = tuple(r[rows] for r in self.rotations)

    def __call__(self, tokens, t: int):
        """Step ``t``: tokens [B] (sampled at t) enter at slot P + t; returns logits [B, V] (float32)."""
        B, D, inner, n = tokens.shape[0], self.head_dim, self.inner, self.P + t
        if self.rotations is None:
            cos, sin = self._cos_sin(self.positions[:, t:t + 1])               # [B, 1, D]
        else:
            cos, sin = self.rotations[0][:, t:t + 1], self.rotations[1][:, t:t + 1]
        half = D // 2  # transformers' x * cos + rotate_half(x) * sin == x * cos + roll(x, D/2) * signed sin
        h = inner.embed_tokens(tokens)                                          # [B, H]
        for (ln1, eps1, q_w, k_w, v_w, o_w, ln2, eps2, g_w, u_w, d_w), kbuf, vbuf in zip(
                self.layers, self.keys, self.values):
            nkv = kbuf.shape[1]
            x = _rms_norm(h, ln1, eps1)
            q, k = F.linear(x, *q_w).view(B, -1, D), F.linear(x, *k_w).view(B, nkv, D)
            q, k = q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
            kbuf[:, :, :, n] = k
            vbuf[:, :, n] = F.linear(x, *v_w).view(B, nkv, D)
            o = _single_query_attention(q.reshape(B * nkv, -1, D),  # GQA: a KV head's query heads as rows
                                        kbuf[..., :n + 1].flatten(0, 1), vbuf[:, :, :n + 1].flatten(0, 1),
                                        self.bias[..., :n + 1].flatten(0, 1), self.scaling)
            h = h + F.linear(o.view(B, -1), *o_w)
            x = _rms_norm(h, ln2, eps2)
            h = h + F.linear(F.silu(F.linear(x, *g_w)) * F.linear(x, *u_w), *d_w)
        return self.model.lm_head(_rms_norm(h, inner.norm.weight, inner.norm.variance_epsilon)).float()


@torch.inference_mode()
def sample_shared_prefix(model, ids, mask, group_size: int, *, max_new_tokens: int, eos_id: int, pad_id: int,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                         step_logits: list | None = None, compact_below: float = 0.75,
                         sampler: str = "inverse_cdf"):
    """G completions per left-padded prompt [N, P] -> token ids [N*G, T'] (T' <= max_new_tokens).

    Each prompt is prefilled once; its K/V are copied G times into buffers of P + T slots that the
    decode steps fill in place and attend over up to the current slot (``_Stepper``). Finished rows
    get ``pad_id``, as generate does; decoding stops once every row has emitted EOS. If
    ``step_logits`` is a list, the raw float32 logits of each step [B, V] are appended to it
    (zeros for rows no longer decoded).

    Compaction: once the unfinished rows are at most ``compact_below`` of the rows still being
    decoded, finished rows leave the batch (their K/V, mask and positions are dropped), so
    short completions stop costing compute. Each row's distribution is unchanged; only the
    mapping of random numbers to rows changes, so ``compact_below=0`` is needed for the
    same-seed-same-samples comparison with ``generate``.

    sampler: "inverse_cdf" (``sample_inverse_cdf``: one uniform number per row; decoding 0.91x
    at hidden 64, 0.95x at 128) or "multinomial" (``torch.multinomial``, generate's: one
    exponential number per vocabulary entry, ~0.15 ms a step at 64 x 108 on one CPU thread; the
    same tokens as generate for the same seed).
    """
    if sampler not in SAMPLERS:
        raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
    G, T = group_size, max_new_tokens
    (N, P), dev = ids.shape, ids.device
    B = N * G
    out, cache = _prefill(model, ids, mask)
    logits = out.logits[:, -1].float().repeat_interleave(G, 0)              # [B, V]
    step = _Stepper(model, cache, mask, G, T)
    del out, cache
    tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)       # [B, T]
    rows = torch.arange(B, device=dev)                                       # [b] rows still decoded
    unfinished = torch.ones(B, dtype=torch.bool, device=dev)                 # [b]
    for t in range(T):
        if step_logits is not None:
            step_logits.append(logits.new_zeros(B, logits.shape[-1]).index_copy_(0, rows, logits))
        if greedy:
            nxt = logits.argmax(-1)
        else:
            probs = torch.softmax(_warp(logits, temperature, top_k, top_p), dim=-1)
            nxt = (sample_inverse_cdf(probs) if sampler == "inverse_cdf"
                   else torch.multinomial(probs, num_samples=1).squeeze(1))  # [b]
        nxt = torch.where(unfinished, nxt, pad_id)
        tokens[rows, t] = nxt
        unfinished &= nxt != eos_id
        left = int(unfinished.sum())
        if t == T - 1 or left == 0:
            break
        if left <= compact_below * len(rows):
            keep = unfinished.nonzero().squeeze(1)
            rows, nxt, unfinished = rows[keep], nxt[keep], unfinished[keep]
            step.keep(keep)
        logits = step(nxt, t)
    return tokens[:, :t + 1]


# ----------------------------------------------------------------------------- scoring

def _forward_inputs(batch: RolloutBatch, device):
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)            # [B, P+T]
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).to(device)  # [B, P+T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                           # as generate does
    return ids, attn, pos


def groups_share_prompts(batch: RolloutBatch) -> bool:
    """True when the G rows of every group hold the same prompt tokens and mask."""
    G = batch.group_size
    if len(batch) % G:
        return False
    ids = batch.prompt_ids.view(-1, G, batch.prompt_ids.shape[1])                      # [N, G, P]
    mask = batch.prompt_mask.view(-1, G, batch.prompt_mask.shape[1])
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


# One more scoring call (reference forward + policy forward and backward) costs about as much as
# this many more positions: measured 1.7 + 2.8 ms per call against 10 + 29 us per position (2-layer
# hidden-64 Llama, one CPU thread: ~115). Larger models make positions dearer and calls relatively
# cheaper, so this errs towards fewer chunks there.
SCORE_CALL_COST = 128


def length_chunks(lengths: list[int], call_cost: float | None = None) -> list[list[int]]:
    """Rows grouped so that each scoring call stops at its own longest completion.

    Positions after a row's EOS are masked out of the loss, yet a padded batch pays for them: with
    lengths spread from 1 to T that is a quarter to half of the work. Rows sorted longest first are
    cut into contiguous chunks minimising sum(rows x longest length) + ``call_cost`` per chunk, an
    exact dynamic programme over the runs of equal length (a cut inside a run never helps).
    Returns row indices per chunk, longest chunk first. ``call_cost`` defaults to ``SCORE_CALL_COST``.
    """
    call_cost = SCORE_CALL_COST if call_cost is None else call_cost
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    runs = []                                                                # (first sorted index, length)
    for k, i in enumerate(order):
        if not runs or lengths[i] != runs[-1][1]:
            runs.append((k, lengths[i]))
    ends = [k for k, _ in runs[1:]] + [len(order)]
    best, cut = [0.0] + [float("inf")] * len(runs), [0] * (len(runs) + 1)   # best[j]: runs[:j] covered
    for j in range(1, len(runs) + 1):
        for i in range(j):
            cost = best[i] + (ends[j - 1] - runs[i][0]) * runs[i][1] + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(runs)
    while j:
        bounds.append((runs[cut[j]][0], ends[j - 1]))
        j = cut[j]
    return [order[a:b] for a, b in reversed(bounds)]


def _shared_prefix_logits(model, batch: RolloutBatch, device):
    """Completion-position logits in pieces: [(rows [b] or None for all rows, logits [b, L, V])], L =
    the piece's longest completion (EOS included); each prompt run once, its KV cache shared by its G rows.

    The cache keeps its autograd graph, so gradients reach the prompt positions as in a full
    forward. Same positions and mask as ``_forward_inputs``, so the logits at every position up
    to a row's EOS equal the full forward's up to float rounding; later positions are not computed.
    """
    G, P = batch.group_size, batch.prompt_ids.shape[1]
    out, prefix = _prefill(model, batch.prompt_ids[::G].to(device), batch.prompt_mask[::G].to(device))
    # Repeated G times first, then rows picked: the backward of a pick with repeated indices
    # (row // G) accumulates in a thread-dependent order; of unique ones, it does not (bitwise resume).
    prefix.batch_repeat_interleave(G)
    first = out.logits[:, -1:].repeat_interleave(G, 0)                                 # [B, 1, V]
    _, attn, pos = _forward_inputs(batch, device)
    lengths = batch.completion_mask.sum(-1).clamp(min=1).tolist()
    chunks, pieces = length_chunks(lengths), []
    for chunk in chunks:
        L = max(lengths[i] for i in chunk)
        if len(chunks) == 1:  # every row, in batch order: nothing to pick
            rows, pick, cache = None, slice(None), prefix
        else:
            rows = pick = torch.tensor(sorted(chunk), device=device)                   # [b]
            cache = type(prefix)(config=model.config)
            for i, layer in enumerate(prefix.layers):
                cache.update(layer.keys[pick], layer.values[pick], i)
        logits = first[pick]                                                           # [b, 1, V]
        if L > 1:
            rest = model(input_ids=batch.completion_ids[pick, :L - 1].to(device), attention_mask=attn[pick, :P + L - 1],
                         position_ids=pos[pick, P:P + L - 1], use_cache=True, **{_cache_kwarg(model): cache}).logits
            logits = torch.cat([logits, rest], 1)                                      # [b, L, V]
        pieces.append((rows, logits))
    return pieces


class CompletionScorer(torch.nn.Module):
    """``completion_logprobs`` of a policy as one module call, for DDP to wrap.

    DDP allows exactly one forward per backward, while shared-prefix scoring calls the model twice
    (the prompts once per group, then the completions on the repeated cache). Wrapping this module
    instead of the bare model makes both calls one DDP forward, so multi-rank training keeps the
    saving. Parameters are the model's own; checkpoints and saved models use ``models.unwrap``.
    """

    def __init__(self, model):
        super().__init__()
        self.module = model  # named as DDP names it, so ``models.unwrap`` strips both layers

    def forward(self, batch: RolloutBatch, temperature: float, with_entropy: bool = False):
        return completion_logprobs(self.module, batch, temperature, with_entropy)


def completion_logprobs(model, batch: RolloutBatch, temperature: float, with_entropy: bool = False):
    """Per-token log-probs of the completion tokens [B, T] (and entropy [B, T] if asked).

    Positions after a row's EOS (``completion_mask`` False) may be skipped and hold 0: mask them,
    as the loss does.

    ``model``: a causal LM, or DDP around a ``CompletionScorer`` (shared-prefix scoring, one DDP
    forward) or around a bare LM (the full forward: the one forward DDP allows).
    """
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if ddp and isinstance(model.module, CompletionScorer):
        return model(batch, temperature, with_entropy)
    device = next(model.parameters()).device
    T, targets = batch.completion_ids.shape[1], batch.completion_ids.to(device)
    if groups_share_prompts(batch) and not ddp:
        pieces = _shared_prefix_logits(model, batch, device)                           # [(rows, [b, L, V])]
    else:
        ids, attn, pos = _forward_inputs(batch, device)
        pieces = [(None, model(input_ids=ids, attention_mask=attn, position_ids=pos,
                               logits_to_keep=T + 1, use_cache=False).logits[:, :-1])]  # [B, T, V]
    logp, ent = [], []
    for rows, logits in pieces:
        pad, pick = (0, T - logits.shape[1]), slice(None) if rows is None else rows
        logp.append(F.pad(token_logprobs(logits, targets[pick, :logits.shape[1]], temperature), pad))
        if with_entropy:
            ent.append(F.pad(token_entropy(logits.detach(), temperature), pad))
    if len(pieces) == 1:
        return logp[0], (ent[0] if with_entropy else None)
    order = torch.cat([rows for rows, _ in pieces]).argsort()                          # back to batch order
    return torch.cat(logp)[order], (torch.cat(ent)[order] if with_entropy else None)   # [B, T]
