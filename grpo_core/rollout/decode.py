"""The shared-prefix decoder: G samples per prompt, each prompt prefilled once.

For Llama/Qwen2-style decoders on SDPA, ``sample_shared_prefix`` prefills each prompt once and
copies its KV cache G times into preallocated buffers; then a lean loop over the model's own
layers (``_Stepper``) samples from softmax(logits / T) (top-k / top-p via transformers' warpers)
by inverting the CDF, stopping when every sequence has emitted EOS. It gives exactly
``generate``'s tokens under greedy decoding, and under sampling with ``sampler="multinomial"``
and the same seed (tests/test_fast_rollout.py); other models use ``generate``.
"""
from __future__ import annotations

import functools
import inspect

import torch
import torch.nn.functional as F

from grpo_core.config.groups import SAMPLERS
from grpo_core.model.lora import is_linear_map, linear_weights
from grpo_core.rollout.loops import LoopRule, LoopTracker

SHARED_PREFIX_ATTENTION = False
"""G > 1: rows attend their prompt's K/V held once per prompt (else each row holds a copy). Off by
default: it holds less memory (the prompt's K/V once, not G times) and decodes faster at large G
(benchmarks/NOTES.md), but its log-sum-exp merge rounds differently from the copied layout, so a
seeded run's samples can differ from the measured default run's; turn it on for large G."""
FAST_DECODE_MODEL_TYPES = ("llama", "qwen2")  # pre-norm RMSNorm, rotary, q/k/v/o attention, SiLU-gated MLP
LINEAR_ATTN, LINEAR_MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")


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
                and all(hasattr(m, "variance_epsilon") for m in (layer.input_layernorm, inner.norm))
                and all(is_linear_map(getattr(block, n)) for each in inner.layers
                        for block, names in ((each.self_attn, LINEAR_ATTN), (each.mlp, LINEAR_MLP)) for n in names))
    except (AttributeError, IndexError, TypeError):  # wrapped or unusual models: use generate
        return False


def cache_kwarg(model) -> str:
    """transformers 5.x renamed ``past_key_values`` to ``cache``; accept either (looked up once
    per forward function, not per call: benchmarks/NOTES.md)."""
    forward = getattr(model, "_orig_mod", model).forward  # torch.compile's wrapper: the model's own
    return _forward_cache_kwarg(getattr(forward, "__func__", forward))  # the function, not a fresh bound method


@functools.lru_cache(maxsize=64)
def _forward_cache_kwarg(forward) -> str:
    params = inspect.signature(forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def prefill(model, ids, mask, logits_to_keep: int | None = 1):
    """Run left-padded prompts [N, P] with generate's position ids; returns (output, DynamicCache).
    ``logits_to_keep=None``: ``model`` is a decoder stack without its LM head (``last_hidden_state``)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = {} if logits_to_keep is None else {"logits_to_keep": logits_to_keep}
    out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True,
                **keep, **{cache_kwarg(model): cache})
    return out, cache


def _warp(logits, temperature: float, top_k: int, top_p: float):
    """The warpers generate applies when sampling, in generate's order: temperature, top-k, top-p."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper
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


def _draw(logits, *, greedy: bool, temperature: float, top_k: int, top_p: float, sampler: str, with_logp: bool):
    """One decode step's next token per row [b] from its logits [b, V]; with ``with_logp`` (sampling
    only) also its log-prob under softmax(logits / temperature) [b], else None."""
    if greedy:
        return logits.argmax(-1), None
    probs = torch.softmax(_warp(logits, temperature, top_k, top_p), dim=-1)
    nxt = sample_inverse_cdf(probs) if sampler == "inverse_cdf" else torch.multinomial(probs, num_samples=1).squeeze(1)
    if not with_logp:
        return nxt, None
    return nxt, _scored_logp(logits, probs, nxt, temperature, filtered=bool(top_k) or top_p < 1.0)


def _scored_logp(logits, probs, tokens, temperature: float, filtered: bool):
    """log softmax(logits / temperature) at ``tokens`` [b]: from ``probs`` (that softmax) when no
    filter changed it, else computed again without the filters."""
    if filtered:
        return torch.log_softmax(logits / temperature, -1).gather(1, tokens[:, None]).squeeze(1)
    return probs.gather(1, tokens[:, None]).squeeze(1).log()


def _rms_norm(x, weight, eps: float):
    """transformers' Llama/Qwen2 RMSNorm (float32 statistics, weight applied last) in one fused op;
    ``F.rms_norm`` is bitwise equal to its x * rsqrt(mean(x^2) + eps) on CPU."""
    return weight * F.rms_norm(x.float(), x.shape[-1:], eps=eps).to(x.dtype)


def _single_query_attention(q, keys_t, values, bias, scale: float):
    """softmax(q K^T * scale + bias) V for one new token per row: two batched GEMVs.

    q [b, rep, D], keys_t [b, D, L] (keys stored transposed: the GEMV reads them in order),
    values [b, L, D], bias [b, 1, L] (0, or -inf at prompt padding); b = rows x KV heads.
    SDPA's CPU flash kernel is built for many queries, not one per row (benchmarks/NOTES.md).
    Same math; the values differ from SDPA's only by summation order (~1e-7).
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
    [B, nkv, 1, P+T] that is -inf at left padding, written once. With G > 1 and
    ``SHARED_PREFIX_ATTENTION``, the prompts' K/V are held once per prompt instead and each row's
    buffers hold its T completion slots only (``_shared_prefix_attention``). With the default rotary
    embedding, cos/sin of every row's T positions are computed once [B, T, D]; scaled variants
    (whose frequencies may depend on the positions seen) get the model's own cos/sin each step.
    """

    def __init__(self, model, cache, mask, group_size: int, max_new_tokens: int):
        """cache: the prefill's DynamicCache of the N prompts [N, nkv, P, D]; mask [N, P]."""
        self.model, self.inner = model, model.model
        attn = self.inner.layers[0].self_attn
        lin = linear_weights  # a LoRA layer's base weight plus its adapters' delta
        self.layers = [(layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon,
                        lin(layer.self_attn.q_proj), lin(layer.self_attn.k_proj), lin(layer.self_attn.v_proj),
                        lin(layer.self_attn.o_proj), layer.post_attention_layernorm.weight,
                        layer.post_attention_layernorm.variance_epsilon,
                        lin(layer.mlp.gate_proj), lin(layer.mlp.up_proj), lin(layer.mlp.down_proj))
                       for layer in self.inner.layers]
        self.head_dim, self.scaling = attn.head_dim, attn.scaling
        G, T = group_size, max_new_tokens
        self.shared = SHARED_PREFIX_ATTENTION and G > 1
        if self.shared:
            self._init_shared_prefix(cache, mask, G, T)
        else:
            self._init_copied_prefix(cache, mask, G, T)
        last = mask.sum(-1).repeat_interleave(G)[:, None] - 1                  # [B, 1] last prompt position
        self.positions = last + torch.arange(1, T + 1, device=last.device)     # [B, T] of the new tokens
        self.rotations = None
        if getattr(self.inner.rotary_emb, "rope_type", "default") == "default":
            self.rotations = self._cos_sin(self.positions)                     # [B, T, D] each

    def _init_copied_prefix(self, cache, mask, G: int, T: int) -> None:
        """Every row's own buffers of P + T slots, its prompt's K/V copied into the first P."""
        P, B = mask.shape[1], mask.shape[0] * G
        self.P, self.keys, self.values = P, [], []
        for layer in cache.layers:
            # keys in the values' dtype: under autocast transformers rotates keys in float32 (values
            # stay bf16) and attention rounds them to bf16 anyway; a float32 buffer was re-cast whole
            # at every step and layer
            k, v = layer.keys, layer.values                                  # [N, nkv, P, D]
            self.keys.append(v.new_empty(B, k.shape[1], k.shape[-1], P + T))   # [B, nkv, D, P+T]
            self.keys[-1][..., :P] = k.transpose(-1, -2).repeat_interleave(G, 0)
            self.values.append(v.new_empty(B, v.shape[1], P + T, v.shape[-1]))  # [B, nkv, P+T, D]
            self.values[-1][:, :, :P] = v.repeat_interleave(G, 0)
        nkv = self.keys[0].shape[1]
        self.bias = self.keys[0].new_zeros(B, nkv, 1, P + T)                   # [B, nkv, 1, P+T]
        self.bias[..., :P].masked_fill_(~mask.bool().repeat_interleave(G, 0)[:, None, None], float("-inf"))

    def _init_shared_prefix(self, cache, mask, G: int, T: int) -> None:
        """The prompt's K/V once per prompt (attended by its G rows as one GEMM), and every row's
        own buffers of T slots for its completion; ``slots`` [b]: each row's index in N x G."""
        (N, P), B = mask.shape, mask.shape[0] * G
        self.P, self.N, self.G, self.keys, self.values = 0, N, G, [], []
        self.prefix_keys = [layer.keys.to(layer.values.dtype).transpose(-1, -2).flatten(0, 1).contiguous()
                            for layer in cache.layers]                         # [N*nkv, D, P]
        self.prefix_values = [layer.values.flatten(0, 1).contiguous() for layer in cache.layers]  # [N*nkv, P, D]
        for layer in cache.layers:
            k, v = layer.keys, layer.values                                  # [N, nkv, P, D]
            self.keys.append(v.new_empty(B, k.shape[1], k.shape[-1], T))       # [B, nkv, D, T]
            self.values.append(v.new_empty(B, v.shape[1], T, v.shape[-1]))     # [B, nkv, T, D]
        nkv = self.keys[0].shape[1]
        bias = self.keys[0].new_zeros(N, nkv, 1, P)
        self.prefix_bias = bias.masked_fill_(~mask.bool()[:, None, None], float("-inf")).flatten(0, 1)  # [N*nkv, 1, P]
        self.slots = torch.arange(B, device=mask.device)                        # [b]

    def _shared_prefix_attention(self, q, layer: int, n: int):
        """Attention of q [b, nkv, rep, D] over the shared prompt and the row's own slots [0, n]:
        the prompt part per prompt as [N*nkv, G*rep, P] GEMMs, merged with the own part by the
        log-sum-exp rule (softmax over the concatenated scores, up to summation order)."""
        b, nkv, rep, D = q.shape
        N, G = self.N, self.G
        grid = q if b == N * G else q.new_zeros(N * G, nkv, rep, D).index_copy_(0, self.slots, q)
        grid = grid.view(N, G, nkv, rep, D).transpose(1, 2).reshape(N * nkv, G * rep, D)
        s1 = torch.baddbmm(self.prefix_bias, grid, self.prefix_keys[layer], alpha=self.scaling)  # [N*nkv, G*rep, P]
        m1 = s1.amax(-1, keepdim=True)
        e1 = torch.exp(s1 - m1)
        o1, d1 = torch.bmm(e1, self.prefix_values[layer]), e1.sum(-1, keepdim=True)
        back = lambda x: x.view(N, nkv, G, rep, -1).transpose(1, 2).reshape(N * G, nkv, rep, -1)[self.slots]  # noqa: E731
        o1, d1, m1 = back(o1), back(d1), back(m1)                                # [b, nkv, rep, *]
        s2 = torch.bmm(q.reshape(b * nkv, rep, D), self.keys[layer][..., :n + 1].flatten(0, 1))
        s2 = (s2 * self.scaling).view(b, nkv, rep, n + 1)                        # [b, nkv, rep, n+1]
        m = torch.maximum(m1, s2.amax(-1, keepdim=True))
        e2 = torch.exp(s2 - m)
        w1 = torch.exp(m1 - m)
        o2 = torch.bmm(e2.view(b * nkv, rep, n + 1), self.values[layer][:, :, :n + 1].flatten(0, 1))
        return (o1 * w1 + o2.view(b, nkv, rep, D)) / (d1 * w1 + e2.sum(-1, keepdim=True))  # [b, nkv, rep, D]

    def _cos_sin(self, positions):
        """cos and sign-flipped sin [B, S, D] at ``positions`` [B, S], from the model's rotary module,
        in the dtype transformers computes them in (the embeddings', which autocast leaves alone)."""
        like = self.inner.embed_tokens.weight.new_empty(0)
        cos, sin = self.inner.rotary_emb(like, positions)
        return cos, _signed_sin(sin)

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in ``rows`` [b] (finished ones) from the state."""
        self.keys, self.values = [k[rows] for k in self.keys], [v[rows] for v in self.values]
        self.positions = self.positions[rows]
        if self.shared:
            self.slots = self.slots[rows]
        else:
            self.bias = self.bias[rows]
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
        for i, ((ln1, eps1, q_w, k_w, v_w, o_w, ln2, eps2, g_w, u_w, d_w), kbuf, vbuf) in enumerate(zip(
                self.layers, self.keys, self.values)):
            nkv = kbuf.shape[1]
            x = _rms_norm(h, ln1, eps1)
            q, k = F.linear(x, *q_w).view(B, -1, D), F.linear(x, *k_w).view(B, nkv, D)
            q, k = q * cos + q.roll(half, -1) * sin, k * cos + k.roll(half, -1) * sin
            kbuf[:, :, :, n] = k
            vbuf[:, :, n] = F.linear(x, *v_w).view(B, nkv, D)
            if self.shared:
                o = self._shared_prefix_attention(q.view(B, nkv, -1, D), i, n)
            else:
                o = _single_query_attention(q.reshape(B * nkv, -1, D),  # GQA: a KV head's query heads as rows
                                            kbuf[..., :n + 1].flatten(0, 1), vbuf[:, :, :n + 1].flatten(0, 1),
                                            self.bias[..., :n + 1].flatten(0, 1), self.scaling)
            h = h + F.linear(o.view(B, -1), *o_w)
            x = _rms_norm(h, ln2, eps2)
            h = h + F.linear(F.silu(F.linear(x, *g_w)) * F.linear(x, *u_w), *d_w)
        return self.model.lm_head(_rms_norm(h, inner.norm.weight, inner.norm.variance_epsilon)).float()


def no_grad_for_sampling(device):
    """``inference_mode`` (cheapest), or ``no_grad`` under autocast: autocast does not keep its
    bf16 copies of the weights inside inference_mode, so every decode step would cast every
    weight again, doubling the bytes a bandwidth-bound step reads."""
    return torch.no_grad() if torch.is_autocast_enabled(device.type) else torch.inference_mode()


def sample_shared_prefix(model, ids, mask, group_size: int, *, max_new_tokens: int, eos_id, pad_id: int,
                         temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, greedy: bool = False,
                         step_logits: list | None = None, compact_below: float = 0.75,
                         sampler: str = "inverse_cdf", loop_rule: LoopRule | None = None,
                         return_logp: bool = False):
    """G completions per left-padded prompt [N, P] -> token ids [N*G, T'] (T' <= max_new_tokens);
    with ``return_logp``, also the log-probs [N*G, T'] (float32) of each sampled token under
    softmax(logits / temperature): the distribution the loss scores (``completion_logprobs``), so
    that with a copy of the weights the ratio measures the copy's gap alone; top-k/top-p stay the
    sampler's filters, outside the ratio, as with the policy's own weights.

    Each prompt is prefilled once; its K/V are copied G times into buffers of P + T slots that the
    decode steps fill in place and attend over up to the current slot (``_Stepper``). Finished rows
    get ``pad_id``, as generate does; decoding stops once every row has emitted EOS (``eos_id``:
    one id or a list of stop ids, any of which ends a row). ``step_logits``, a list, receives the
    raw float32 logits of each step [B, V] (zeros for rows no longer decoded).

    Compaction: once the unfinished rows are at most ``compact_below`` of those still decoded,
    finished rows leave the batch, so short completions stop costing compute. Each row's
    distribution is unchanged, only the mapping of random numbers to rows (``compact_below=0``
    for the same-seed-same-samples comparison with ``generate``).

    sampler: "inverse_cdf" (``sample_inverse_cdf``: one uniform number per row, the faster) or
    "multinomial" (generate's ``torch.multinomial``: the same tokens as generate for a seed).
    loop_rule: stop a row at the first step where its tail is a verbatim loop (``loops.py``).
    """
    with no_grad_for_sampling(ids.device):
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if return_logp and greedy:
            raise ValueError("return_logp is for sampling: a greedy token has no sampling probability")
        G, T, dev = group_size, max_new_tokens, ids.device
        B = ids.shape[0] * G
        out, cache = prefill(model, ids, mask)
        logits = out.logits[:, -1].float().repeat_interleave(G, 0)              # [B, V]
        step = _Stepper(model, cache, mask, G, T)
        del out, cache
        stop = torch.as_tensor(eos_id, device=dev).flatten()                      # [S] stop ids
        tokens = torch.full((B, T), pad_id, dtype=torch.long, device=dev)       # [B, T]
        logp = torch.zeros((B, T), dtype=torch.float32, device=dev) if return_logp else None  # [B, T]
        rows = torch.arange(B, device=dev)                                       # [b] rows still decoded
        unfinished = torch.ones(B, dtype=torch.bool, device=dev)                 # [b]
        loops = LoopTracker(B, loop_rule, dev) if loop_rule is not None else None
        draw = functools.partial(_draw, greedy=greedy, temperature=temperature, top_k=top_k, top_p=top_p,
                                 sampler=sampler, with_logp=return_logp)
        for t in range(T):
            if step_logits is not None:
                step_logits.append(logits.new_zeros(B, logits.shape[-1]).index_copy_(0, rows, logits))
            nxt, nxt_logp = draw(logits)                                         # [b], [b] or None
            if nxt_logp is not None:
                logp[rows, t] = nxt_logp
            nxt = torch.where(unfinished, nxt, pad_id)
            tokens[rows, t] = nxt
            unfinished &= (nxt != stop[0]) if len(stop) == 1 else ~torch.isin(nxt, stop)
            if loops is not None:
                unfinished &= ~loops.step(tokens, rows, t)
            left = int(unfinished.sum())
            if t == T - 1 or left == 0:
                break
            if left <= compact_below * len(rows):
                keep = unfinished.nonzero().squeeze(1)
                rows, nxt, unfinished = rows[keep], nxt[keep], unfinished[keep]
                step.keep(keep)
                if loops is not None:
                    loops.keep(keep)
            logits = step(nxt, t)
        return tokens[:, :t + 1] if logp is None else (tokens[:, :t + 1], logp[:, :t + 1])
