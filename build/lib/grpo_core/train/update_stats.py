"""One update's statistics over its micro-batches (the update itself: ``trainer.Trainer._update``;
the model's side of it: ``policy.Policy``)."""
from __future__ import annotations


class MergedStats:
    """One update's statistics over its micro-batches, as if computed on the whole rank batch:
    token means weighted by tokens, the losses summed with the micro-batch weights, max as max."""

    MEANS = ("kl", "clip_frac_low", "clip_frac_high", "clip_frac", "ratio_mean", "entropy")

    def __init__(self):
        self.sums = dict.fromkeys(self.MEANS, 0.0)
        self.tokens = self.loss = self.pg_loss = self.ratio_max = 0.0

    def add(self, stats: dict, entropy: float, loss: float, weight: float) -> None:
        """``stats`` of one micro-batch's grpo_loss, its entropy, its weighted loss and weight."""
        n = stats["num_tokens"]
        for k in self.MEANS:
            self.sums[k] += (entropy if k == "entropy" else stats[k]) * n
        self.tokens += n
        self.loss += loss
        self.pg_loss += stats["pg_loss"] * weight
        self.ratio_max = max(self.ratio_max, stats["ratio_max"])

    def result(self) -> dict:
        means = {k: v / max(self.tokens, 1.0) for k, v in self.sums.items()}
        return {**means, "loss": self.loss, "pg_loss": self.pg_loss, "ratio_max": self.ratio_max,
                "num_tokens": self.tokens}
