"""GRPO math: group advantages, the k3 KL estimator, and chunked log-probs (the losses: `losses`).

Pure functions of tensors: no model, no I/O, no torch.distributed. The trainer owns the collectives
and passes their results in (e.g. `global_token_count`).

Shape legend (used in every docstring and trailing comment):
    B  sequences in the batch = prompts * G
    G  group size (completions per prompt); rows are group-contiguous: all G of prompt 0, then prompt 1, ...
    T  completion tokens (padded); `mask` marks the real ones
    V  vocabulary size

Semantics chosen (where implementations differ):
    - Std is Bessel-corrected (n-1), as torch `.std()`, TRL and verl; eps = 1e-4 (TRL) is added to the std.
    - An all-equal group gets advantage exactly 0 (forced, not left to floating-point cancellation).
    - KL is Schulman's k3 estimator, exp(ref - logp) - (ref - logp) - 1 >= 0, per token, NOT multiplied by
      the importance ratio (TRL 1.16's `use_bias_correction_kl` does; we do not).
    - Log-ratios are clamped to +-MAX_LOG_RATIO before exp, both in importance ratios and in k3; inside that
      range the result is exact, outside it the token gets zero gradient instead of inf/NaN.
    - The policy losses (PPO clip per token, GSPO, CISPO; their aggregations) are entries in `losses`.
"""

import math

import torch
from torch import Tensor

MAX_LOG_RATIO = 20.0  # exp(20) ~ 4.9e8 is finite in float32 and far beyond any ratio that still carries signal
ADVANTAGE_SCALES = ("group", "batch", "none")


# ----------------------------------------------------------------------------- helpers

def _float_dtype(x: Tensor) -> torch.dtype:
    """float32 for float16/bfloat16/integers, float64 stays float64."""
    return torch.promote_types(x.dtype, torch.float32)


def masked_mean(x: Tensor, mask: Tensor) -> Tensor:
    """Mean of `x` over positions where `mask` is True; 0 when the mask is empty.

    x: any shape; mask: bool, same shape as x. Values of x under ~mask are ignored (even NaN/inf).
    """
    mask = mask.to(torch.bool)
    total = torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device)).sum()
    return total / mask.sum().clamp(min=1)


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """Validate and reshape rewards [N] -> [N/G, G] in float32 or wider."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [N], got shape {tuple(rewards.shape)}; flatten it first")
    if not isinstance(group_size, int) or group_size < 2:
        raise ValueError(f"group_size must be an int >= 2 (a group of one has no baseline), got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"group_size={group_size} does not divide the number of rewards N={rewards.numel()}; "
            "pass all G completions of every prompt"
        )
    return rewards.to(_float_dtype(rewards)).view(-1, group_size)  # [N/G, G]


# ----------------------------------------------------------------------------- advantages

_ADV_DENOMINATORS = {  # scale name -> (grouped rewards [N/G, G], eps) -> denominator broadcastable to [N/G, G]
    "group": lambda r, eps: r.std(dim=1, keepdim=True) + eps,  # [N/G, 1], Bessel
    "batch": lambda r, eps: r.std() + eps,  # scalar, Bessel over all N
    "none": lambda r, eps: torch.ones((), dtype=r.dtype, device=r.device),  # Dr. GRPO: mean-centring only
}


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     batch_std: float | None = None) -> Tensor:
    """Group-relative advantages.

    rewards: [N] (N = B), group-contiguous. Returns [N] in float32 (float64 if rewards are float64).
    scale="group": (r - group_mean) / (group_std + eps); "batch": (r - group_mean) / (batch_std + eps);
    "none": r - group_mean (Dr. GRPO). Std is Bessel-corrected. All-equal groups get exactly 0.
    batch_std: the "batch" std when ``rewards`` are one shard of a larger batch (the trainer passes
    the std over all ranks' rewards, ``Trainer.advantages``); default: the std of ``rewards``.
    """
    if scale not in _ADV_DENOMINATORS:
        raise ValueError(f"scale must be one of {ADVANTAGE_SCALES}, got {scale!r}")
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if batch_std is not None and not (scale == "batch" and batch_std >= 0):
        raise ValueError(f"batch_std must be >= 0 and goes with scale='batch', got {batch_std!r} "
                         f"with scale={scale!r}")
    r = _grouped(rewards, group_size)  # [N/G, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [N/G, G]
    denominator = (_ADV_DENOMINATORS[scale](r, eps) if batch_std is None
                   else torch.tensor(batch_std + eps, dtype=r.dtype, device=r.device))
    adv = centred / denominator  # [N/G, G]
    informative = (r != r[:, :1]).any(dim=1, keepdim=True)  # [N/G, 1]
    return torch.where(informative, adv, torch.zeros_like(adv)).reshape(-1)  # [N]


def std_from_moments(total: float, total_sq: float, count: float) -> float:
    """Bessel-corrected std from sum, sum of squares and count (e.g. summed over ranks in float64)."""
    if count < 2:
        return 0.0
    return math.sqrt(max(total_sq - total * total / count, 0.0) / (count - 1))


def informative_mask(rewards: Tensor, group_size: int) -> Tensor:
    """rewards: [N] group-contiguous -> bool [N/G], True where the group's rewards are not all equal."""
    r = _grouped(rewards, group_size)  # [N/G, G]
    return (r != r[:, :1]).any(dim=1)


# ----------------------------------------------------------------------------- KL

def k3_kl(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(pi || ref): exp(d) - d - 1 with d = ref_logp - logp, >= 0.

    logp, ref_logp: same shape (typically [B, T]). d is clamped to +-MAX_LOG_RATIO before exp.
    """
    d = (ref_logp - logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    return torch.exp(d) - d - 1


# ----------------------------------------------------------------------------- chunked log-probs / entropy

def _row_chunks(x: Tensor, chunk_size: int):
    """Yield (start, chunk [n, D]) over the flattened rows of x [..., D] (logits, hidden states)."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = x.reshape(-1, x.shape[-1])  # [B*T, D]
    for start in range(0, flat.shape[0], chunk_size):
        yield start, flat[start:start + chunk_size]


def _logits_grad(minus_softmax: Tensor, targets: Tensor, grad_out: Tensor, tau: float) -> Tensor:
    """d loss / d logits of log_softmax(logits / tau).gather(targets) for n rows: (onehot - softmax)
    x grad_out / tau, built in place in ``minus_softmax`` [n, V]; targets and grad_out: [n, 1]."""
    minus_softmax.scatter_add_(-1, targets, torch.ones_like(targets, dtype=minus_softmax.dtype))
    return minus_softmax.mul_(grad_out / tau)


class _TokenLogprobs(torch.autograd.Function):
    """log_softmax(logits / tau).gather(targets), chunked in forward AND backward.

    Saves only the original logits and the [B*T] logsumexp, so neither pass holds a float32 [B, T, V]
    (plain autograd over chunks would keep every upcast chunk alive until backward).
    """

    @staticmethod
    def forward(ctx, logits, targets, temperature, chunk_size):
        tgt = targets.reshape(-1, 1)  # [B*T, 1]
        out, lse = [], []
        for start, chunk in _row_chunks(logits, chunk_size):
            z = chunk.to(_float_dtype(chunk)) / temperature  # [n, V], the only upcast copy
            lse.append(torch.logsumexp(z, dim=-1))  # [n]
            out.append(z.gather(-1, tgt[start:start + len(z)]).squeeze(-1) - lse[-1])  # [n]
        ctx.save_for_backward(logits, targets, torch.cat(lse))
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return torch.cat(out).view(targets.shape)  # [B, T]

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        logits, targets, lse = ctx.saved_tensors
        tau = ctx.temperature
        tgt, g = targets.reshape(-1, 1), grad_out.reshape(-1, 1)  # [B*T, 1]
        grad = logits.new_empty(tgt.shape[0], logits.shape[-1])  # [B*T, V] in the logits dtype
        for start, chunk in _row_chunks(logits, ctx.chunk_size):
            rows = slice(start, start + len(chunk))
            z = chunk.to(_float_dtype(chunk)) / tau  # [n, V]
            grad[rows] = _logits_grad(-torch.exp(z - lse[rows, None]), tgt[rows], g[rows], tau).to(grad.dtype)
        return grad.view(logits.shape), None, None, None


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Log-prob of each target token under softmax(logits / temperature), differentiable w.r.t. logits.

    logits: [B, T, V] (any float dtype); targets: [B, T] valid token ids (mask padding afterwards).
    Returns [B, T] in float32 (float64 for float64 logits). Rows are processed `chunk_size` at a time.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"targets must be logits.shape[:-1] = {tuple(logits.shape[:-1])}, got {tuple(targets.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    return _TokenLogprobs.apply(logits, targets, float(temperature), int(chunk_size))


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits / temperature) per position, chunked; detached.

    logits: [B, T, V] -> [B, T] in float32 (float64 for float64 logits).
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    out = []
    for _, chunk in _row_chunks(logits, chunk_size):
        z = chunk.to(_float_dtype(chunk)) / temperature  # [n, V]
        logp = z - torch.logsumexp(z, dim=-1, keepdim=True)  # [n, V]
        out.append(-(logp.exp() * logp).sum(dim=-1))  # [n]
    return torch.cat(out).view(logits.shape[:-1])  # [B, T]


class _HeadLogprobs(torch.autograd.Function):
    """log_softmax((hidden @ weight.T + bias) / tau).gather(targets) without the [N, V] logits.

    The LM head runs ``chunk_size`` positions at a time in forward, and again in backward (one more
    head matmul per position), so neither pass holds logits or their gradient for more than one
    chunk. Saved for backward: hidden, the weight, the [N] logsumexp and, with ``keep_last``, the
    last chunk's softmax, which backward then need not recompute (every chunk, when the positions
    fit in one). Matmuls run in ``compute_dtype`` (an autocast dtype, or the hidden states' own),
    the softmax math in float32 (float64 stays), and the weight's gradient sums in float32 at least.
    The entropy, when asked, comes from the same forward logits and carries no gradient. Backward
    runs once (it reuses the kept softmax's memory).
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk_size, compute_dtype, with_entropy,
                keep_last):
        w = weight.to(compute_dtype)  # one copy per call, not per chunk (a no-op when dtypes match)
        b = None if bias is None else bias.to(compute_dtype)
        logp, lse, ent, probs = [], [], [], None
        for start, h in _row_chunks(hidden, chunk_size):
            h = h.to(compute_dtype)  # [n, H]
            z = torch.nn.functional.linear(h, w, b)
            z = z.to(_float_dtype(z)) / temperature  # [n, V]
            lse.append(torch.logsumexp(z, dim=-1))  # [n]
            logp.append(z.gather(-1, targets[start:start + len(h), None]).squeeze(-1) - lse[-1])
            last = start + chunk_size >= hidden.shape[0]
            if with_entropy or (keep_last and last):
                p = torch.exp(z - lse[-1][:, None])  # [n, V] softmax
                if with_entropy:
                    ent.append(lse[-1] - (p * z).sum(-1))  # H = lse - E[z]
                if keep_last and last:
                    probs = p
        ctx.save_for_backward(hidden, weight, bias, targets, torch.cat(lse), probs)
        ctx.temperature, ctx.chunk_size, ctx.compute_dtype = temperature, chunk_size, compute_dtype
        entropy = torch.cat(ent) if with_entropy else hidden.new_zeros(0)
        ctx.mark_non_differentiable(entropy)
        return torch.cat(logp), entropy

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_logp, _grad_entropy):
        hidden, weight, bias, targets, lse, probs = ctx.saved_tensors
        tau, cdt = ctx.temperature, ctx.compute_dtype
        w = weight.to(cdt)
        b = None if bias is None else bias.to(cdt)
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        acc = torch.promote_types(cdt, torch.float32)  # bf16 matmuls, float32 sums over chunks
        grad_w = torch.zeros_like(weight, dtype=acc) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias, dtype=acc) if bias is not None and ctx.needs_input_grad[2] else None
        for start, h in _row_chunks(hidden, ctx.chunk_size):
            rows, h = slice(start, start + len(h)), h.to(cdt)  # [n, H]
            if probs is not None and start + ctx.chunk_size >= hidden.shape[0]:
                minus_softmax = probs.neg_()  # [n, V], kept from forward (backward runs once)
            else:
                z = torch.nn.functional.linear(h, w, b)
                z = z.to(_float_dtype(z)) / tau  # [n, V], recomputed
                minus_softmax = -torch.exp(z - lse[rows, None])
            d = _logits_grad(minus_softmax, targets[rows, None], grad_logp[rows, None], tau).to(cdt)
            if grad_h is not None:
                grad_h[rows] = (d @ w).to(hidden.dtype)  # [n, H]
            if grad_w is not None:  # [V, H]
                grad_w.addmm_(d.t(), h) if acc == cdt else grad_w.add_(torch.mm(d.t(), h))
            if grad_b is not None:
                grad_b += d.sum(0)
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None, None)


def head_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float = 1.0,
                  bias: Tensor | None = None, chunk_size: int = 1024, compute_dtype: torch.dtype | None = None,
                  with_entropy: bool = False, keep_last: bool = True) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each target token under softmax((hidden @ weight.T + bias) / temperature), and
    its entropy if asked: ``token_logprobs``/``token_entropy`` of the LM head's logits, computed
    ``chunk_size`` positions at a time so no [B, T, V] logits (or logits gradient) ever exist.

    hidden: [B, T, H] (the decoder's final states); weight: [V, H]; bias: [V] or None; targets:
    [B, T] valid ids. Differentiable w.r.t. hidden, weight and bias. compute_dtype: the matmuls'
    dtype (default hidden's; pass autocast's dtype to match an autocast forward). keep_last: keep the
    last chunk's [<= chunk_size, V] softmax for backward (under grad only) instead of recomputing
    it; a caller that scores in several calls keeps it in one, to hold one chunk in all. Returns
    logp [B, T] in float32 (float64 for float64 inputs) and entropy [B, T] detached, or None.
    """
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"targets must be hidden.shape[:-1] = {tuple(hidden.shape[:-1])}, got {tuple(targets.shape)}")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be [V, {hidden.shape[-1]}] for hidden [..., {hidden.shape[-1]}], "
                         f"got {tuple(weight.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    flat = hidden.reshape(-1, hidden.shape[-1])  # [B*T, H]; chunk_size is checked by _row_chunks
    logp, ent = _HeadLogprobs.apply(flat, weight, bias, targets.reshape(-1), float(temperature), int(chunk_size),
                                    compute_dtype or hidden.dtype, bool(with_entropy),
                                    keep_last and torch.is_grad_enabled())
    return logp.view(targets.shape), (ent.view(targets.shape) if with_entropy else None)
