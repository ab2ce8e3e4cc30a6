"""The parts of one policy update around the pure loss math (``algorithm.py``): the scorer the
update differentiates through (DDP-wrapped, or compiled), the constant log-probs of the reference
and old policy, the optimizer's kernel choice, and the statistics of an update split into
micro-batches."""
from __future__ import annotations

import contextlib

import torch

from grpo_core.policy import dist
from grpo_core.policy.scoring import CompletionScorer, completion_logprobs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import no_grad_for_sampling


def wrap_ddp(model, info: dist.DistInfo):
    """DDP around the policy's scorer, so shared-prefix scoring is one forward per backward."""
    ids = [info.local_rank] if info.device.type == "cuda" else None
    return torch.nn.parallel.DistributedDataParallel(CompletionScorer(model), device_ids=ids)


def compile_for_scoring(model):
    """``torch.compile`` of a policy for scoring: dynamic shapes, since every batch's rows, prompt
    length and completion chunks differ (static shapes would recompile nearly every call). The
    compiled module shares the model's parameters; the decoder and checkpoints use the model.

    The policy and the reference share transformers' forward code, and dynamo keeps one cache of
    compiled variants per code object: prompt vs completion calls, with and without grad, for both
    models. Its default limit (8) could be reached and silently fall back to eager, so it is raised.
    """
    try:
        import torch._inductor.compile_fx
    except TypeError as e:  # seen in a process where metaflow's vendored typing_extensions was loaded
        raise RuntimeError(
            f"compile_scoring: torch's compiler cannot be loaded in this process ({e}). Another copy of "
            "typing_extensions (metaflow vendors one) replaced typing._collect_parameters. Train in a "
            "process of its own (python -m grpo_core.train, or torchrun, as the flow's steps do), or set "
            "compile_scoring = false.") from e
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(model, dynamic=True)


def precision_context(precision: str, device: torch.device):
    """A fresh context manager for one forward (``GRPOConfig.precision``): bf16 is ``torch.autocast``
    to bfloat16 on the device (matmuls and attention in bf16; weights, gradients, optimizer state and
    the log-softmax/loss math stay float32, as ``token_logprobs`` upcasts logits); fp32 does nothing.
    Backward runs outside it, as autocast wants."""
    if precision == "bf16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def fused_adamw_ok(model) -> bool:
    """torch's fused AdamW (one kernel per parameter; also HF Trainer's default) where it exists:
    float parameters on CPU or CUDA (its timing: benchmarks/NOTES.md)."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters())


def scored_without_grad(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Completion log-probs [B, T] as constants (reference / old policy). Under ``inference_mode``
    (no version counters or view tracking; ``no_grad`` under autocast, which keeps its bf16 weight
    copies only outside it), then cloned into a normal tensor, which the loss's autograd graph may
    hold."""
    with no_grad_for_sampling(next(model.parameters()).device):
        logp, _ = completion_logprobs(model, batch, temperature)
    return logp.clone()


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
