"""GRPO math: group advantages, the clipped policy loss with a k3 KL penalty, and chunked log-probs.

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
    - The PPO clip applies to the ratio only: -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A). The KL term is
      never clipped. clip_high=None means symmetric (DAPO's "clip-higher" sets clip_high > clip_low).
    - Log-ratios are clamped to +-MAX_LOG_RATIO before exp, both in the ratio and in k3; inside that range the
      result is exact, outside it the token gets zero gradient instead of inf/NaN.
    - With old_logp = logp.detach() (one update per rollout) r == 1 in value: the loss is ~0 and clipping never
      fires, but the gradient is the plain policy gradient.
    - Loss aggregation ("grpo", "bnpo", "dapo", "dr_grpo") is documented in `grpo_loss`.
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


# ----------------------------------------------------------------------------- loss aggregation
# Each takes per-token values x [B, T] and a float mask [B, T] (1 = real token) and returns a scalar.
# All are linear in x, so the loss and its policy-gradient part can be aggregated independently.

def _agg_grpo(x: Tensor, m: Tensor, *, global_sequence_count=None, world_size: int = 1, **_) -> Tensor:
    """Mean over each sequence's tokens, then over sequences (DeepSeekMath). Empty rows count as 0.
    With ``global_sequence_count`` (sequences summed over ranks): local sum * world_size / that
    count, so DDP's mean over ranks is the mean over all sequences even when ranks hold different
    numbers of them (dynamic sampling)."""
    per_seq = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
    if global_sequence_count is None:
        return per_seq.mean()
    return per_seq.sum() * world_size / max(float(global_sequence_count), 1.0)


def _agg_bnpo(x: Tensor, m: Tensor, **_) -> Tensor:
    """Sum over this batch's tokens / this batch's token count."""
    return (x * m).sum() / m.sum().clamp(min=1)


def _agg_dapo(x: Tensor, m: Tensor, *, global_token_count=None, world_size: int = 1, **_) -> Tensor:
    """local_sum * world_size / global_token_count: DDP's mean over ranks then gives global_sum / global_count."""
    if global_token_count is None:
        return _agg_bnpo(x, m)
    count = torch.as_tensor(global_token_count, dtype=x.dtype, device=x.device).detach().clamp(min=1)
    return (x * m).sum() * world_size / count


def _agg_dr_grpo(x: Tensor, m: Tensor, *, max_completion_length=None, global_sequence_count=None,
                 world_size: int = 1, **_) -> Tensor:
    """Sum / (B * max_completion_length): a constant denominator (Dr. GRPO), no length bias. With
    ``global_sequence_count``, B is that count and the sum is scaled by world_size (as grpo)."""
    if global_sequence_count is None:
        return (x * m).sum() / (x.shape[0] * max_completion_length)
    return (x * m).sum() * world_size / (max(float(global_sequence_count), 1.0) * max_completion_length)


LOSS_AGGREGATIONS = {"grpo": _agg_grpo, "bnpo": _agg_bnpo, "dapo": _agg_dapo, "dr_grpo": _agg_dr_grpo}


def micro_batch_weight(loss_type: str, rows: int, total_rows: int, tokens: float, total_tokens: float,
                       global_counts: bool = True) -> float:
    """Factor for one micro-batch's ``grpo_loss`` so that the weighted losses of a rank's batch
    split into micro-batches (of ``rows`` sequences and ``tokens`` active tokens each) sum to the
    loss of the whole batch, and so do their gradients (gradient accumulation changes nothing).

    bnpo divides by this batch's token count: tokens / total_tokens. With ``global_counts`` (the
    caller passes the whole batch's global_token_count and global_sequence_count to every
    micro-batch) dapo, grpo and dr_grpo are sums over the micro-batches already: 1. Without them
    grpo and dr_grpo divide by the micro-batch's sequence count (rows / total_rows) and dapo falls
    back to bnpo.
    """
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    if not 0 < rows <= total_rows:
        raise ValueError(f"rows must be in 1..total_rows={total_rows}, got {rows}")
    if loss_type == "bnpo" or (loss_type == "dapo" and not global_counts):
        return float(tokens) / max(float(total_tokens), 1.0)
    if loss_type in ("grpo", "dr_grpo") and not global_counts:
        return rows / total_rows
    return 1.0


# ----------------------------------------------------------------------------- policy loss

def _validate_loss_args(logp, old_logp, ref_logp, advantages, mask, clip_low, clip_high, beta,
                        loss_type, max_completion_length, world_size) -> None:
    if loss_type not in LOSS_AGGREGATIONS:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_AGGREGATIONS)}, got {loss_type!r}")
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high), ("beta", beta)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"ref_logp is None but beta={beta}; pass reference log-probs or set beta=0")
    if loss_type == "dr_grpo" and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError("loss_type='dr_grpo' needs max_completion_length > 0 (the generation token budget)")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    for name, t in (("old_logp", old_logp), ("ref_logp", ref_logp), ("mask", mask)):
        if t is not None and t.shape != logp.shape:
            raise ValueError(f"{name} must have logp's shape {tuple(logp.shape)} [B, T], got {tuple(t.shape)}")
    if advantages.shape != logp.shape[:1]:
        raise ValueError(f"advantages must be [B] = {tuple(logp.shape[:1])} (one per sequence), "
                         f"got {tuple(advantages.shape)}")


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor, *,
              clip_low: float = 0.2, clip_high: float | None = None, beta: float = 0.04, loss_type: str = "dapo",
              max_completion_length: int | None = None, global_token_count=None,
              global_sequence_count=None, world_size: int = 1) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO objective with a k3 KL penalty, aggregated by `loss_type`.

    logp:       [B, T] log-probs of the sampled tokens under the current policy (requires grad)
    old_logp:   [B, T] log-probs under the sampling policy (detached)
    ref_logp:   [B, T] log-probs under the reference policy, or None when beta == 0
    advantages: [B]    one per sequence, broadcast over its tokens
    mask:       [B, T] bool, True on completion tokens that count; other positions are ignored
    Per token: -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A) + beta*k3, r = exp(logp - old_logp).
    loss_type:  "grpo"    mean per sequence, then mean over the B sequences (empty sequences contribute 0);
                          with global_sequence_count: sum of the per-sequence means * world_size / that count;
                "bnpo"    sum / this batch's token count;
                "dapo"    sum * world_size / global_token_count, where global_token_count is the active-token
                          count all-reduced over ranks and micro-batches; DDP's gradient mean then equals the
                          single-process gradient however the batch is split. None -> same as "bnpo";
                "dr_grpo" sum / (B * max_completion_length); with global_sequence_count, B is that count and
                          the sum is scaled by world_size.
    global_sequence_count: sequences summed over ranks and micro-batches; makes grpo and dr_grpo independent
                          of the split too (ranks holding different numbers of sequences, e.g. after dynamic
                          sampling, would otherwise weight a sequence by 1 / its rank's count).
    Returns (loss scalar, stats of python floats): kl, clip_frac_low, clip_frac_high, clip_frac, ratio_mean,
    ratio_max, pg_loss (aggregated like the loss), num_tokens (local).
    """
    _validate_loss_args(logp, old_logp, ref_logp, advantages, mask, clip_low, clip_high, beta,
                        loss_type, max_completion_length, world_size)
    clip_high = clip_low if clip_high is None else clip_high
    dtype = _float_dtype(logp)
    mask = mask.to(torch.bool)
    m = mask.to(dtype)  # [B, T]
    zero = torch.zeros((), dtype=dtype, device=logp.device)
    # padded positions may hold garbage (even inf/NaN); zero them so neither value nor gradient sees them
    logp, old_logp = (torch.where(mask, t.to(dtype), zero) for t in (logp, old_logp))  # [B, T]
    ref_logp = torch.where(mask, ref_logp.to(dtype), zero) if ref_logp is not None else None  # [B, T]
    adv = advantages.to(dtype)[:, None]  # [B, 1]

    ratio = torch.exp((logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))  # [B, T]
    clipped_ratio = ratio.clamp(1 - clip_low, 1 + clip_high)  # [B, T]
    pg = -torch.minimum(ratio * adv, clipped_ratio * adv)  # [B, T]
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else None  # [B, T]
    per_token = pg + beta * kl if beta != 0 else pg  # [B, T]

    agg = LOSS_AGGREGATIONS[loss_type]
    norm = dict(max_completion_length=max_completion_length, global_token_count=global_token_count,
                global_sequence_count=global_sequence_count, world_size=world_size)
    loss = agg(per_token, m, **norm)
    with torch.no_grad():
        low = masked_mean(((adv < 0) & (ratio < 1 - clip_low)).to(dtype), mask)
        high = masked_mean(((adv > 0) & (ratio > 1 + clip_high)).to(dtype), mask)
        stats = {
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "clip_frac_low": low.item(),
            "clip_frac_high": high.item(),
            "clip_frac": (low + high).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask].max().item() if mask.any() else 0.0,
            "pg_loss": agg(pg, m, **norm).item(),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, stats


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
