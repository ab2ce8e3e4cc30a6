"""The record that crosses stage boundaries: rollout -> rewards -> advantages -> update.

Shapes: B = prompts x G completions (group-contiguous: all G samples of prompt 0 first),
P = prompt tokens (left-padded), T = completion tokens (right-padded after EOS).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor          # [B, P] left-padded prompt tokens
    prompt_mask: torch.Tensor         # [B, P] 1 for real prompt tokens
    completion_ids: torch.Tensor      # [B, T] sampled tokens, pad after EOS
    completion_mask: torch.Tensor     # [B, T] bool: tokens up to and including EOS
    truncated: torch.Tensor           # [B] bool: no EOS within max_new_tokens
    group_size: int                   # G
    prompts: list[str]                # [B] raw prompt (question) per completion
    completions: list[str]            # [B] decoded completion text (special tokens dropped)
    columns: dict[str, list] = field(default_factory=dict)  # dataset fields per completion (see reward_columns)
    rewards: torch.Tensor | None = None       # [B] combined reward
    advantages: torch.Tensor | None = None    # [B] group-relative advantage
    old_logp: torch.Tensor | None = None      # [B, T] behaviour log-probs (mu > 1 only)
    ref_logp: torch.Tensor | None = None      # [B, T] reference log-probs (beta > 0 only)
    loss_rows: torch.Tensor | None = None     # [B] bool: rows the loss counts (None: all of them)
    reward_parts: torch.Tensor | None = None  # [B, K] each reward function's raw value (nan: not applicable)
    sampler_logp: torch.Tensor | None = None  # [B, T] the engine's log-probs of its samples (None: trained weights)

    def __len__(self) -> int:
        return self.completion_ids.shape[0]

    def reward_columns(self) -> dict[str, list]:
        """The dataset fields reward functions receive as keyword arguments (TRL's ``**kwargs``),
        one value per completion: every column except ``id`` (bookkeeping) and ``think`` (the
        worked solution: the SFT target, GSM8K's rationale). A verifiable reward checks the answer
        against ``gold``, not the path against a reference."""
        return {k: v for k, v in self.columns.items() if k not in ("id", "think")}

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    def select_groups(self, keep: torch.Tensor) -> "RolloutBatch":
        """Keep whole groups where ``keep`` ([B/G] bool) is True (dynamic sampling)."""
        rows = keep.repeat_interleave(self.group_size).nonzero().squeeze(-1)  # [B']
        idx = rows.tolist()
        pick = lambda t: None if t is None else t[rows]  # noqa: E731
        return RolloutBatch(
            self.prompt_ids[rows], self.prompt_mask[rows], self.completion_ids[rows],
            self.completion_mask[rows], self.truncated[rows], self.group_size,
            [self.prompts[i] for i in idx], [self.completions[i] for i in idx],
            {k: [v[i] for i in idx] for k, v in self.columns.items()},
            pick(self.rewards), pick(self.advantages), pick(self.old_logp), pick(self.ref_logp),
            pick(self.loss_rows), pick(self.reward_parts), pick(self.sampler_logp))

    def split_groups(self, groups_per_part: int) -> list["RolloutBatch"]:
        """Consecutive parts of at most ``groups_per_part`` whole groups (micro-batches of the
        update); 0, or at least ``num_groups``, gives ``[self]``."""
        if groups_per_part <= 0 or groups_per_part >= self.num_groups:
            return [self]
        ids = torch.arange(self.num_groups)
        return [self.select_groups((ids >= a) & (ids < a + groups_per_part))
                for a in range(0, self.num_groups, groups_per_part)]

    @staticmethod
    def concat(batches: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Join batches, re-padding prompts on the left and completions on the right."""
        if len(batches) == 1:
            return batches[0]
        P = max(b.prompt_ids.shape[1] for b in batches)
        T = max(b.completion_ids.shape[1] for b in batches)
        left = lambda t, w, v: torch.nn.functional.pad(t, (w - t.shape[1], 0), value=v)  # noqa: E731
        right = lambda t, w, v: torch.nn.functional.pad(t, (0, w - t.shape[1]), value=v)  # noqa: E731
        cat = lambda f: None if getattr(batches[0], f) is None else torch.cat(  # noqa: E731
            [getattr(b, f) for b in batches])
        return RolloutBatch(
            torch.cat([left(b.prompt_ids, P, pad_id) for b in batches]),
            torch.cat([left(b.prompt_mask, P, 0) for b in batches]),
            torch.cat([right(b.completion_ids, T, pad_id) for b in batches]),
            torch.cat([right(b.completion_mask, T, False) for b in batches]),
            torch.cat([b.truncated for b in batches]), batches[0].group_size,
            sum((b.prompts for b in batches), []), sum((b.completions for b in batches), []),
            {k: sum((b.columns[k] for b in batches), []) for k in batches[0].columns},
            cat("rewards"), cat("advantages"), loss_rows=cat("loss_rows"), reward_parts=cat("reward_parts"),
            sampler_logp=None if batches[0].sampler_logp is None else torch.cat(
                [right(b.sampler_logp, T, 0.0) for b in batches]))
