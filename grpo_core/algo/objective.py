"""The objective card: exactly which GRPO objective a stage optimised, written beside its metrics.

Implementations differ silently (std flavour, eps, loss normaliser, KL estimator and whether it
is importance-weighted, scoring temperature, old log-prob recomputation); this card records
our choices so two runs or two libraries can be compared honestly.
"""
from __future__ import annotations

from grpo_core.algo.losses import loss_entry

SCALES = {"group": "(r - group mean) / (group std + eps)",
          "batch": "(r - group mean) / (std over all ranks' rewards + eps)",
          "none": "r - group mean (Dr. GRPO)"}


def objective_card(cfg, world_size: int, rendered_prompt: str | None = None) -> dict:
    """The stage's objective; ``rendered_prompt``: one training prompt exactly as the policy sees it
    (chat template and system message applied), so the prompt format is on record too."""
    clip_high = cfg.loss.clip_low if cfg.loss.clip_high is None else cfg.loss.clip_high
    loss = loss_entry(cfg.loss.type)
    return {
        "loss_type": cfg.loss.type,
        "normaliser": loss.normaliser,
        "advantage": SCALES[cfg.loss.scale],
        "advantage_std": "Bessel-corrected (n-1)",
        "advantage_eps": cfg.loss.adv_eps,
        "surrogate": loss.surrogate.format(lo=f"{1 - cfg.loss.clip_low:g}", hi=f"{1 + clip_high:g}"),
        "kl_estimator": "k3 = exp(ref - logp) - (ref - logp) - 1, per token, not importance-weighted"
                        if cfg.loss.beta > 0 else "none (beta = 0, no reference model)",
        "reference": ("none" if cfg.loss.beta == 0 else "the policy with its LoRA adapters off" if cfg.lora.rank
                      else "a frozen copy of the stage's starting policy"),
        "trained_weights": (f"LoRA adapters: rank {cfg.lora.rank}, alpha {cfg.lora.alpha:g} (scale "
                            f"{cfg.lora.alpha / cfg.lora.rank:g}), dropout {cfg.lora.dropout:g}, on "
                            f"{cfg.lora.target_modules}" if cfg.lora.rank else "all (full fine-tuning)"),
        "beta": cfg.loss.beta,
        "scoring_temperature": cfg.sampling.temperature,
        "sampling": {"temperature": cfg.sampling.temperature, "top_p": cfg.sampling.top_p, "top_k": cfg.sampling.top_k},
        "old_logp": "recomputed once per rollout batch (no grad)" if cfg.optim.mu > 1
                    else ("logp.detach() (on-policy, mu = 1): the ratio is exactly 1 in value, so the "
                          "reported loss is ~beta*KL while its gradient is the policy gradient"),
        "updates_per_batch": cfg.optim.mu,
        "rollout_engine": cfg.sampling.rollout_engine,
        "rollout_correction": rollout_correction(cfg),
        "precision": "bf16 autocast (float32 weights, optimizer and loss math)" if cfg.execution.precision == "bf16"
                     else "fp32",
        "micro_batch_groups": cfg.execution.micro_batch_groups or "all of a rank's groups (no accumulation)",
        "truncated_completions": "masked out of the loss" if cfg.loss.mask_truncated else "kept",
        "dynamic_sampling": cfg.sampling.dynamic_sampling,
        "world_size": world_size,
        "parallelism": ("fsdp2: weights, gradients and AdamW state sharded over the ranks (FSDP "
                        + ("bf16 gather, fp32 gradient reduction" if cfg.execution.precision == "bf16" else "fp32")
                        + "); full weights gathered for rollouts and reference scoring"
                        if cfg.execution.parallelism == "fsdp2" else
                        "ddp: a full copy per rank, gradients all-reduced" if world_size > 1 else "one process"),
        "reward_functions": cfg.rewards,
        "system_prompt": cfg.system_prompt if cfg.system_prompt is not None else "none (the chat template's default)",
        "rendered_prompt_example": rendered_prompt,
    }


IS_LINES = {"sequence_mask": "r = exp(sum over the sequence of (old_logp - sampler_logp)); weight r if r <= {cap:g}, "
                             "else 0 (the sequence leaves the policy term)",
            "sequence_truncate": "r = exp(sum over the sequence of (old_logp - sampler_logp)); weight min(r, {cap:g})",
            "token_mask": "r = exp(old_logp - sampler_logp) per token; weight r if r <= {cap:g}, else 0",
            "token_truncate": "r = exp(old_logp - sampler_logp) per token; weight min(r, {cap:g})",
            "none": "none (the gap and ratio are measured only)"}


def rollout_correction(cfg) -> str:
    """How the policy term is reweighted for the engine sampling from its own copy of the weights."""
    if cfg.sampling.rollout_engine != "vllm" and cfg.sampling.rollout_precision == "fp32":
        return "none: the in-process engine samples with the trained weights themselves (r = 1)"
    line = IS_LINES[cfg.loss.rollout_is].format(cap=cfg.loss.rollout_is_cap)
    sampler = "a vLLM server" if cfg.sampling.rollout_engine == "vllm" else "a bf16 copy of the policy"
    return (f"{cfg.loss.rollout_is}: {line}; the weight is detached and multiplies the policy term, not the KL "
            f"(sampler: {sampler})")
