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

def _row_chunks(logits: Tensor, chunk_size: int):
    """Yield (start, chunk [n, V]) over the flattened rows of logits [B, T, V]."""
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    flat = logits.reshape(-1, logits.shape[-1])  # [B*T, V]
    for start in range(0, flat.shape[0], chunk_size):
        yield start, flat[start:start + chunk_size]


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
            d = -torch.exp(z - lse[rows, None])  # [n, V] d logp / d z = onehot - softmax
            d.scatter_add_(-1, tgt[rows], torch.ones_like(tgt[rows], dtype=d.dtype))
            grad[rows] = (d * (g[rows] / tau)).to(grad.dtype)
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
