"""The trained model and how it runs, in one object: `Policy` loads it, attaches LoRA, wraps it for
DDP or shards it with FSDP2, compiles its scorer, sets its precision, and answers the trainer's
questions about it (log-probs with and without gradients, the reference's log-probs, the weights
an engine samples with, the state to checkpoint and the final model). The trainer holds one
handle and reads as the GRPO loop; how the model is parallelised stays here.
"""
from __future__ import annotations

import contextlib

import torch

from grpo_core.config.checks import ConfigError
from grpo_core.model import lora
from grpo_core.model.loading import (
    activation_checkpointing_paused,
    disable_dropout,
    enable_activation_checkpointing,
    load_policy,
)
from grpo_core.policy import dist, scoring, sharding
from grpo_core.policy.scoring import CompletionScorer, completion_logprobs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import no_grad_for_sampling


class Policy:
    """One stage's policy on this rank. ``model`` is the module the engine samples with and the
    checkpoints save (its parameters are FSDP2 shards under ``fsdp2``); ``trained`` is what the
    update differentiates through (DDP around a scorer on > 1 rank, the FSDP2 root, or the
    possibly compiled model itself). The reference is the stage's starting policy: a frozen copy,
    or with LoRA the same model with its adapters off, so no second copy of the weights."""

    def __init__(self, cfg, info: dist.DistInfo):
        self.cfg, self.info, where = cfg, info, f"stage '{cfg.runtime.stage}'"
        self.model, self.tok = load_policy(cfg.runtime.model, trust_remote_code=cfg.trust_remote_code)
        if cfg.disable_dropout:
            disable_dropout(self.model)
        self.lora = lora.attach(self.model, cfg.lora, where) if cfg.lora.rank else None  # peft's handle
        self.model.to(info.device).train()
        self.checkpointing = cfg.execution.gradient_checkpointing
        if self.checkpointing:
            try:
                enable_activation_checkpointing(self.model)
            except ValueError as exc:
                raise ConfigError(f"{where}.execution.gradient_checkpointing: {exc}; set it to false") from exc
        self.sharded = cfg.execution.parallelism == "fsdp2"
        if self.sharded and info.world_size < 2:
            raise ConfigError(f"{where}.execution.parallelism: 'fsdp2' shards over ranks, but this stage runs as one "
                              "process; start it with torchrun --nproc_per_node >= 2, or use 'ddp'")
        self.ref, self.ref_root = self._frozen_reference()
        self.scorer, self.ref_scorer = self.model, self.ref
        if cfg.execution.compile_scoring:
            self.scorer = compile_for_scoring(self.model)
            self.ref_scorer = compile_for_scoring(self.ref) if self.ref is not None else None
        self.trained = self.scorer
        if self.sharded:
            self.trained = sharding.shard(self.model, cfg.execution.precision)  # the model's parameters become shards
        elif info.world_size > 1:
            self.trained = wrap_ddp(self.scorer, info)

    def _frozen_reference(self):
        """A frozen copy of the starting weights when the loss has a KL term and there is no LoRA
        (sharded too under FSDP2, and gathered for its scoring); else (None, None)."""
        cfg = self.cfg
        if cfg.loss.beta <= 0 or self.lora is not None:
            return None, None
        ref, _ = load_policy(cfg.runtime.model, trust_remote_code=cfg.trust_remote_code)
        ref.to(self.info.device).eval().requires_grad_(False)
        return ref, (sharding.shard(ref, cfg.execution.precision) if self.sharded else None)

    # ---------------------------------------------------------------- what the update asks
    def optimizer(self) -> torch.optim.AdamW:
        """AdamW over the trained parameters (all, or LoRA's adapters), fused where it exists."""
        o = self.cfg.optim
        trained = [p for p in self.model.parameters() if p.requires_grad]
        return torch.optim.AdamW(trained, lr=o.lr, weight_decay=o.weight_decay,
                                 fused=fused_adamw_ok(self.model) and not self.sharded)

    def logprobs(self, part: RolloutBatch, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Completion log-probs and entropies [B, T] with gradients, in the stage's precision
        (the forward only: backward follows autocast's forward dtypes)."""
        with self.precision():
            return completion_logprobs(self.trained, part, temperature, with_entropy=True)

    def old_logprobs(self, parts: list[RolloutBatch], temperature: float) -> list[torch.Tensor]:
        """The current policy's log-probs of each part as constants (the ratio's denominator when
        mu > 1)."""
        with self.forward_only():
            return [scored_without_grad(self.scorer, part, temperature) for part in parts]

    @property
    def has_reference(self) -> bool:
        return self.cfg.loss.beta > 0

    def reference_logprobs(self, parts: list[RolloutBatch], temperature: float) -> list[torch.Tensor]:
        """The stage's starting policy's log-probs of each part as constants: the frozen copy's,
        or under LoRA the model's own with its adapters off (uncompiled: a compiled graph may bake
        them in)."""
        if self.ref is not None:
            with self.forward_only(self.ref_root):
                return [scored_without_grad(self.ref_scorer, part, temperature) for part in parts]
        with self.forward_only(), lora.reference_mode(self.lora):
            return [scored_without_grad(self.model, part, temperature) for part in parts]

    def accumulating(self, accumulate: bool):
        """DDP's ``no_sync`` while gradients accumulate over micro-batches; else nothing."""
        if accumulate and isinstance(self.trained, torch.nn.parallel.DistributedDataParallel):
            return self.trained.no_sync()
        return contextlib.nullcontext()

    def clip_grad_norm(self, limit: float) -> float:
        """Clip the gradients to ``limit`` (total norm over all shards) and return the norm."""
        return sharding.full_value(torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)).item()

    def precision(self):
        return precision_context(self.cfg.execution.precision, self.info.device)

    @contextlib.contextmanager
    def forward_only(self, sharded_root=None):
        """Forwards with no backward (rollouts, reference/old scoring, evaluation): the stage's
        precision, activation checkpointing paused (if on: pausing scans every module), and with
        fsdp2 the full weights gathered (the policy's, or ``sharded_root``'s: the reference's)."""
        paused = activation_checkpointing_paused(self.model) if self.checkpointing else contextlib.nullcontext()
        full = sharding.gathered(sharded_root or self.trained) if self.sharded else contextlib.nullcontext()
        with full, self.precision(), paused:
            yield

    # ---------------------------------------------------------------- weights in and out
    @contextlib.contextmanager
    def synced(self, engine):
        """A block where ``engine`` samples with the current weights: under FSDP2 the full weights
        are gathered once, for the sync and the sampling both."""
        with self.forward_only():
            engine.sync_weights(self.model)
            yield engine

    def shard_writer(self, opt):
        """Under FSDP2, the function that writes this rank's shards of model and optimizer to a
        checkpoint directory (None otherwise: the full state is saved instead)."""
        return (lambda d: sharding.save_state(self.trained, opt, d)) if self.sharded else None

    def shard_reader(self, opt):
        return (lambda d: sharding.load_state(self.trained, opt, d)) if self.sharded else None

    def full_state_dict(self) -> dict | None:
        """The gathered full weights under FSDP2 (every rank must call it), else None."""
        return sharding.full_state_dict(self.trained) if self.sharded else None

    def final_model(self):
        """The model to publish: a plain transformers model (LoRA merged, no peft)."""
        return self.model if self.lora is None else lora.merged(self.lora)


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
    float parameters on CPU or CUDA."""
    return all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in model.parameters())


def scored_without_grad(model, batch: RolloutBatch, temperature: float) -> torch.Tensor:
    """Completion log-probs [B, T] as constants (reference / old policy). Under ``inference_mode``
    (no version counters or view tracking; ``no_grad`` under autocast, which keeps its bf16 weight
    copies only outside it), then cloned into a normal tensor, which the loss's autograd graph may
    hold."""
    with no_grad_for_sampling(next(model.parameters()).device):
        logp, _ = scoring.completion_logprobs(model, batch, temperature)
    return logp.clone()
