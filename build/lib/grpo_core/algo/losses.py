"""The GRPO-family policy losses: one `LossType` entry per loss, and `grpo_loss`, which applies one.

An entry holds everything that differs between losses: the per-token policy term (how the
importance ratio enters and is clipped), the aggregation over tokens and sequences, the weight of
one micro-batch under gradient accumulation, the arguments it needs, and the lines the objective
card and the configuration reference print. Adding a loss is adding one entry to `LOSS_TYPES`.

Pure functions of tensors (shape legend in `algorithm`): no model, no I/O, no torch.distributed.
The KL penalty (k3, per token, never clipped) is the same for every loss and is added to the
policy term before aggregation.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo_core.algo.core import MAX_LOG_RATIO, _float_dtype, k3_kl, masked_mean

# ----------------------------------------------------------------------------- aggregations
# Each takes per-token values x [B, T] and a float mask [B, T] (1 = real token) and returns a scalar.
# All are linear in x, so the loss and its policy-gradient part can be aggregated independently.


def _agg_sequence_mean(x: Tensor, m: Tensor, *, global_sequence_count=None, world_size: int = 1, **_) -> Tensor:
    """Mean over each sequence's tokens, then over sequences (DeepSeekMath). Empty rows count as 0.
    With ``global_sequence_count`` (sequences summed over ranks): local sum * world_size / that
    count, so DDP's mean over ranks is the mean over all sequences even when ranks hold different
    numbers of them (dynamic sampling)."""
    per_seq = (x * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)  # [B]
    if global_sequence_count is None:
        return per_seq.mean()
    return per_seq.sum() * world_size / max(float(global_sequence_count), 1.0)


def _agg_local_token_mean(x: Tensor, m: Tensor, **_) -> Tensor:
    """Sum over this batch's tokens / this batch's token count."""
    return (x * m).sum() / m.sum().clamp(min=1)


def _agg_global_token_mean(x: Tensor, m: Tensor, *, global_token_count=None, world_size: int = 1, **_) -> Tensor:
    """local_sum * world_size / global_token_count: DDP's mean over ranks then gives global_sum /
    global_count. Without ``global_token_count``, the local token mean."""
    if global_token_count is None:
        return _agg_local_token_mean(x, m)
    count = torch.as_tensor(global_token_count, dtype=x.dtype, device=x.device).detach().clamp(min=1)
    return (x * m).sum() * world_size / count


def _agg_constant(x: Tensor, m: Tensor, *, max_completion_length=None, global_sequence_count=None,
                  world_size: int = 1, **_) -> Tensor:
    """Sum / (B * max_completion_length): a constant denominator (Dr. GRPO), no length bias. With
    ``global_sequence_count``, B is that count and the sum is scaled by world_size."""
    if global_sequence_count is None:
        return (x * m).sum() / (x.shape[0] * max_completion_length)
    return (x * m).sum() * world_size / (max(float(global_sequence_count), 1.0) * max_completion_length)


# ----------------------------------------------------------------------------- micro-batch weights
# (rows, total_rows, tokens, total_tokens, global_counts) -> the factor for one micro-batch's loss such
# that the weighted micro-batch losses (and gradients) sum to the whole batch's.

def _weight_sequences(rows, total_rows, tokens, total_tokens, global_counts) -> float:
    """Per-sequence denominators: a sum already with global counts, else rows / total_rows."""
    return 1.0 if global_counts else rows / total_rows


def _weight_local_tokens(rows, total_rows, tokens, total_tokens, global_counts) -> float:
    """The local token mean divides by the micro-batch's tokens: tokens / total_tokens."""
    return float(tokens) / max(float(total_tokens), 1.0)


def _weight_global_tokens(rows, total_rows, tokens, total_tokens, global_counts) -> float:
    """A sum already with the global token count; without it the local token mean's weight."""
    return 1.0 if global_counts else _weight_local_tokens(rows, total_rows, tokens, total_tokens, False)


# ----------------------------------------------------------------------------- policy terms
# (logp, old_logp, adv [B, 1], mask bool [B, T], clip_low, clip_high) ->
#     (per-token policy loss [B, T], ratio [B, T], clipped_low bool [B, T], clipped_high bool [B, T])

def _log_ratio(logp: Tensor, old_logp: Tensor) -> Tensor:
    return (logp - old_logp).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)


def _token_clip(logp, old_logp, adv, mask, clip_low, clip_high):
    """PPO's clipped surrogate per token: -min(r*A, clip(r, 1-clip_low, 1+clip_high)*A)."""
    ratio = torch.exp(_log_ratio(logp, old_logp))  # [B, T]
    pg = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_low, 1 + clip_high) * adv)  # [B, T]
    return pg, ratio, (adv < 0) & (ratio < 1 - clip_low), (adv > 0) & (ratio > 1 + clip_high)


def _sequence_clip(logp, old_logp, adv, mask, clip_low, clip_high):
    """GSPO: one ratio per sequence, s = exp(mean over its tokens of (logp - old_logp)), clipped as PPO
    clips a token's; the value -min(s*A, clip(s)*A) stands on every token of the sequence (so a
    per-sequence mean aggregation gives one term per sequence). Empty sequences get s = 1."""
    m = mask.to(logp.dtype)
    mean_log_ratio = ((logp - old_logp) * m).sum(dim=1, keepdim=True) / m.sum(dim=1, keepdim=True).clamp(min=1)
    s = torch.exp(mean_log_ratio.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)).expand_as(logp)  # [B, T]
    pg = -torch.minimum(s * adv, s.clamp(1 - clip_low, 1 + clip_high) * adv)  # [B, T]
    return pg, s, (adv < 0) & (s < 1 - clip_low), (adv > 0) & (s > 1 + clip_high)


def _clipped_is_weight(logp, old_logp, adv, mask, clip_low, clip_high):
    """CISPO: -sg(clip(r, 1-clip_low, 1+clip_high)) * A * logp per token. The weight is clipped and
    detached, so no token's gradient is ever dropped (PPO's clip zeroes it); the value is a
    surrogate whose gradient is the clipped-IS-weighted policy gradient, not a loss to read."""
    ratio = torch.exp(_log_ratio(logp, old_logp))  # [B, T]
    weight = ratio.clamp(1 - clip_low, 1 + clip_high).detach()  # [B, T]
    return -weight * adv * logp, ratio, ratio < 1 - clip_low, ratio > 1 + clip_high


# ----------------------------------------------------------------------------- the entries

@dataclass(frozen=True)
class LossType:
    """One loss: how the ratio enters (``policy_term``), how tokens are aggregated (``aggregate``,
    ``micro_batch_weight``), what it needs, and how the objective card and the config reference
    describe it."""
    policy_term: Callable
    aggregate: Callable
    micro_batch_weight: Callable
    surrogate: str  # per-token formula; {lo} and {hi} are the clip bounds
    normaliser: str
    reproduces: str
    needs_max_completion_length: bool = False


_PPO_SURROGATE = "-min(r*A, clip(r, {lo}, {hi})*A), r = exp(logp - old_logp) per token"

LOSS_TYPES: dict[str, LossType] = {
    "grpo": LossType(
        _token_clip, _agg_sequence_mean, _weight_sequences, _PPO_SURROGATE,
        "mean over each sequence's tokens, then mean over all ranks' sequences",
        "DeepSeekMath GRPO (Shao et al. 2024)"),
    "bnpo": LossType(
        _token_clip, _agg_local_token_mean, _weight_local_tokens, _PPO_SURROGATE,
        "sum over masked tokens / masked-token count of the local batch",
        "TRL's bnpo"),
    "dapo": LossType(
        _token_clip, _agg_global_token_mean, _weight_global_tokens, _PPO_SURROGATE,
        "sum over masked tokens / masked-token count of the global batch (all-reduced over ranks)",
        "DAPO's token-level loss (Yu et al. 2025); with clip_high = 0.28, its clip-higher"),
    "dr_grpo": LossType(
        _token_clip, _agg_constant, _weight_sequences, _PPO_SURROGATE,
        "sum over masked tokens / (all ranks' sequences x max_completion_length)",
        "Dr. GRPO (Liu et al. 2025) with scale = \"none\"", needs_max_completion_length=True),
    "gspo": LossType(
        _sequence_clip, _agg_sequence_mean, _weight_sequences,
        "-min(s*A, clip(s, {lo}, {hi})*A), s = exp(mean over the sequence of (logp - old_logp))",
        "one term per sequence (its tokens share s), mean over all ranks' sequences",
        "GSPO (Zheng et al. 2025) with clip_low = 3e-4, clip_high = 4e-4, beta = 0"),
    "cispo": LossType(
        _clipped_is_weight, _agg_global_token_mean, _weight_global_tokens,
        "-sg(clip(r, {lo}, {hi}))*A*logp, r = exp(logp - old_logp) per token",
        "sum over masked tokens / masked-token count of the global batch (all-reduced over ranks)",
        "CISPO (MiniMax-M1, 2025) with clip_low = 1 (no lower bound), a tuned clip_high, beta = 0"),
}


def loss_entry(loss_type: str) -> LossType:
    """The entry for ``loss_type``; a ValueError naming the choices otherwise."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {tuple(LOSS_TYPES)}, got {loss_type!r}")
    return LOSS_TYPES[loss_type]


def micro_batch_weight(loss_type: str, rows: int, total_rows: int, tokens: float, total_tokens: float,
                       global_counts: bool = True) -> float:
    """Factor for one micro-batch's ``grpo_loss`` so that the weighted losses of a rank's batch
    split into micro-batches (of ``rows`` sequences and ``tokens`` active tokens each) sum to the
    loss of the whole batch, and so do their gradients (gradient accumulation changes nothing).
    ``global_counts``: the caller passes the whole batch's global_token_count and
    global_sequence_count to every micro-batch."""
    entry = loss_entry(loss_type)
    if not 0 < rows <= total_rows:
        raise ValueError(f"rows must be in 1..total_rows={total_rows}, got {rows}")
    return entry.micro_batch_weight(rows, total_rows, tokens, total_tokens, global_counts)


# ----------------------------------------------------------------------------- rollout/trainer mismatch

ROLLOUT_IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "none")


def rollout_is_weights(old_logp: Tensor, sampler_logp: Tensor, mask: Tensor, mode: str = "sequence_mask",
                       cap: float = 3.0) -> tuple[Tensor, dict[str, Tensor]]:
    """Importance weights that correct for an engine sampling from its own copy of the policy.

    old_logp: [B, T] the trainer's log-probs of the sampled tokens (the policy the update starts
    from); sampler_logp: [B, T] the engine's; mask: [B, T] bool. The ratio is r = exp(old_logp -
    sampler_logp) per token (token_*), or exp of its sum over the sequence on each of the
    sequence's tokens (sequence_*), the log clamped to +-MAX_LOG_RATIO. truncate: min(r, cap);
    mask: r where r <= cap, else 0; none: 1 (measure only). Returns (weights [B, T], detached, 0
    off the mask; stats: the masked tokens' ``tokens``, ``gap_sum`` and ``gap_max`` of |old_logp -
    sampler_logp|, ``ratio_sum``, ``ratio_min`` and ``ratio_max`` of r before the cap, ``capped``:
    tokens whose weight the cap changed)."""
    if mode not in ROLLOUT_IS_MODES:
        raise ValueError(f"rollout_is must be one of {ROLLOUT_IS_MODES}, got {mode!r}")
    if cap < 1:
        raise ValueError(f"rollout_is_cap must be >= 1, got {cap}")
    mask = mask.to(torch.bool)
    zero = torch.zeros((), dtype=_float_dtype(old_logp), device=old_logp.device)
    diff = torch.where(mask, old_logp.detach() - sampler_logp.to(old_logp.device), zero)    # [B, T]
    log_r = diff.sum(dim=1, keepdim=True).expand_as(diff) if mode.startswith("sequence") else diff
    ratio = torch.exp(log_r.clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO))                           # [B, T]
    if mode.endswith("truncate"):
        weight = ratio.clamp(max=cap)
    elif mode.endswith("mask"):
        weight = ratio.masked_fill(ratio > cap, 0.0)
    else:
        weight = torch.ones_like(ratio)
    weight = torch.where(mask, weight, zero)
    any_token = bool(mask.any())
    inf = torch.tensor(float("inf"), dtype=ratio.dtype, device=ratio.device)
    stats = {"tokens": mask.sum().to(ratio.dtype), "gap_sum": diff.abs().sum(),
             "gap_max": diff.abs().max() if any_token else zero, "ratio_sum": torch.where(mask, ratio, zero).sum(),
             "ratio_min": ratio[mask].min() if any_token else inf,
             "ratio_max": ratio[mask].max() if any_token else -inf,
             "capped": ((ratio > cap) & mask).sum().to(ratio.dtype) if mode != "none" else zero}
    return weight, stats


# ----------------------------------------------------------------------------- the loss

def _validate_loss_args(logp, old_logp, ref_logp, advantages, mask, clip_low, clip_high, beta,
                        loss_type, max_completion_length, world_size) -> LossType:
    entry = loss_entry(loss_type)
    for name, value in (("clip_low", clip_low), ("clip_high", clip_high), ("beta", beta)):
        if value is not None and value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if ref_logp is None and beta != 0:
        raise ValueError(f"ref_logp is None but beta={beta}; pass reference log-probs or set beta=0")
    if entry.needs_max_completion_length and (max_completion_length is None or max_completion_length <= 0):
        raise ValueError(f"loss_type={loss_type!r} needs max_completion_length > 0 (the generation token budget)")
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
    return entry


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor, *,
              clip_low: float = 0.2, clip_high: float | None = None, beta: float = 0.04, loss_type: str = "dapo",
              max_completion_length: int | None = None, global_token_count=None,
              global_sequence_count=None, world_size: int = 1,
              is_weight: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of ``loss_type`` plus beta * k3 KL per token, aggregated as the entry says.

    logp:       [B, T] log-probs of the sampled tokens under the current policy (requires grad)
    old_logp:   [B, T] log-probs under the sampling policy (detached)
    ref_logp:   [B, T] log-probs under the reference policy, or None when beta == 0
    advantages: [B]    one per sequence, broadcast over its tokens
    mask:       [B, T] bool, True on completion tokens that count; other positions are ignored
    clip_high:  None means symmetric (= clip_low).
    global_token_count: active tokens all-reduced over ranks and micro-batches (token-mean losses);
    global_sequence_count: sequences summed likewise (sequence-mean losses). With them, DDP's
                gradient mean equals the single-process gradient however the batch is split.
    is_weight:  [B, T] rollout/trainer importance weights (``rollout_is_weights``), multiplying the
                policy term per token (not the KL); None: no correction (an in-process engine).
    Returns (loss scalar, stats of python floats): kl, clip_frac_low, clip_frac_high, clip_frac,
    ratio_mean, ratio_max, pg_loss (aggregated like the loss), num_tokens (local).
    """
    entry = _validate_loss_args(logp, old_logp, ref_logp, advantages, mask, clip_low, clip_high, beta,
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

    pg, ratio, clipped_low, clipped_high = entry.policy_term(logp, old_logp, adv, mask, clip_low, clip_high)
    if is_weight is not None:
        pg = pg * torch.where(mask, is_weight.detach().to(dtype), zero)  # [B, T]
    kl = k3_kl(logp, ref_logp) if ref_logp is not None else None  # [B, T]
    per_token = pg + beta * kl if beta != 0 else pg  # [B, T]

    norm = dict(max_completion_length=max_completion_length, global_token_count=global_token_count,
                global_sequence_count=global_sequence_count, world_size=world_size)
    loss = entry.aggregate(per_token, m, **norm)
    with torch.no_grad():
        low = masked_mean(clipped_low.to(dtype), mask)
        high = masked_mean(clipped_high.to(dtype), mask)
        stats = {
            "kl": masked_mean(kl, mask).item() if kl is not None else 0.0,
            "clip_frac_low": low.item(),
            "clip_frac_high": high.item(),
            "clip_frac": (low + high).item(),
            "ratio_mean": masked_mean(ratio, mask).item(),
            "ratio_max": ratio[mask].max().item() if mask.any() else 0.0,
            "pg_loss": entry.aggregate(pg, m, **norm).item(),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, stats
