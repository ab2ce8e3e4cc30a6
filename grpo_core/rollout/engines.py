"""Rollout engines: the one seam between the trainer and whatever samples completions.

An engine turns prompt rows into a ``RolloutBatch`` of G completions per row, sampled from the
policy's current weights. The trainer calls exactly two methods, before every rollout:

    engine.sync_weights(model)          # the policy as it is now (after the last update)
    engine.generate(rows, G, sampling)  # -> RolloutBatch, group-contiguous

``sync_weights`` is where an engine that keeps its own copy of the weights (a vLLM server, a
separate inference process) would receive them. It is called inside the trainer's forward-only
phase, so under FSDP2 the module it gets holds full, gathered weights.

The evaluation decodes through the same seam (``evaluate.greedy_results`` with
``Sampling(greedy=True)``): in a stage, with the stage's engine; in the final evaluation step,
with "auto".

The in-process engines sample with the policy module itself, so syncing only records the module;
with ``rollout_precision = "bf16"`` they sample with a bfloat16 copy of its parameters instead,
refreshed at every sync, and return its log-probs of its samples as the vllm engine does.
The ``vllm`` engine (``grpo_core.rollout.vllm_engine``) samples with a vLLM server of its own environment,
so syncing sends it the weights; it also returns the sampled tokens' log-probs
(``RolloutBatch.sampler_logp``), which the loss uses to correct the rollout/trainer mismatch.
Adding an engine is one class with these two methods (and ``close``) plus its ``ENGINES`` entry,
a factory of ``(tok, spec)`` (``EngineSpec``: what an engine may need beyond the tokenizer, taken
from a stage's config or from the evaluation's), and its name in the config's ``ROLLOUT_ENGINES``
(the vocabulary a config file may use, validated at load; a test holds the two lists equal).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from grpo_core.rollout.batch import RolloutBatch


@dataclass(frozen=True)
class Sampling:
    """How completions are drawn (a stage's sampling fields; see ``GRPOConfig``)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 32
    max_prompt_tokens: int = 512
    sampler: str = "inverse_cdf"
    system_prompt: str | None = None
    greedy: bool = False
    """Argmax tokens instead of samples (the evaluation's decoding; temperature and filters unused)."""
    stop_loops: bool = False
    """Stop a completion once it repeats itself verbatim (``loops.LoopRule``; the evaluation's)."""

    @classmethod
    def of(cls, cfg) -> Sampling:
        s = cfg.sampling
        return cls(s.temperature, s.top_p, s.top_k, s.max_new_tokens, s.max_prompt_tokens, s.sampler, cfg.system_prompt)


@dataclass(frozen=True)
class EngineSpec:
    """What an engine may need beyond the tokenizer. In-process engines read ``rollout_precision``
    only; the vllm engine starts its server from the rest. Built from a stage's config (``of_stage``) or by the
    evaluation step from ``[evaluate]``."""

    vllm: Any = None
    """The server's settings (``config.groups.VllmSettings``)."""
    precision: str = "fp32"
    """fp32 or bf16: the served weights' dtype."""
    max_model_len: int = 2048
    """Longest prompt + completion the engine is asked for."""
    seed: int = 0
    log_dir: str = "."
    """Where an engine's own process writes its log."""
    where: str = "vllm"
    """The config table ``vllm`` came from, named in its errors (``gsm8k.vllm``, ``evaluate.vllm``)."""
    rollout_precision: str = "fp32"
    """The in-process engines' sampling weights: fp32 (the module's own) or bf16 (a copy)."""

    @classmethod
    def of_stage(cls, cfg) -> EngineSpec:
        """A GRPO stage's: its vLLM table, precision and seed; the longest sequence its rollouts
        or its validation ask for; logs beside its checkpoints."""
        s = cfg.sampling
        return cls(cfg.vllm, cfg.execution.precision,
                   s.max_prompt_tokens + max(s.max_new_tokens, cfg.eval_max_new_tokens()), cfg.seed,
                   str(Path(cfg.runtime.output_dir)), f"{cfg.runtime.stage}.vllm" if cfg.runtime.stage else "vllm",
                   s.rollout_precision)


class RolloutEngine(Protocol):
    def sync_weights(self, model) -> None:
        """Take the policy's current weights; called before every rollout."""

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        """``group_size`` completions of every row (each a dict with ``prompt`` plus dataset
        columns), group-contiguous, with the rows' columns repeated per completion."""


class InProcessEngine:
    """Samples in this process. ``mode``: "auto" (the shared-prefix decoder where
    ``decode.fast_decode_supported``, else transformers' ``generate``), "decoder" (insist on the
    decoder) or "generate" (always ``generate``). ``precision``: "fp32" samples with the policy
    module itself; "bf16" with a bfloat16 copy of its parameters (``Bf16Copy``), whose log-probs of
    its samples go into the batch (``sampler_logp``) for the loss's rollout correction. Greedy
    decoding (the evaluations') always uses the policy itself: accuracies, and the gates that
    read them, mean the same at either precision."""

    def __init__(self, tok, mode: str = "auto", precision: str = "fp32"):
        if mode == "generate" and precision != "fp32":
            raise ValueError("rollout_precision = 'bf16' needs the shared-prefix decoder; the 'generate' engine "
                             "samples with the policy itself: use rollout_engine = 'decoder' or "
                             "rollout_precision = 'fp32'")
        self.tok, self.mode, self.model, self.sampler = tok, mode, None, None
        self.copy = Bf16Copy() if precision == "bf16" else None

    def sync_weights(self, model) -> None:
        self.sampler = model if self.copy is None else self.copy.sync(model)  # fp32: nothing to copy
        self.model = model

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        from grpo_core.rollout.generate import generate_rollouts  # transformers: not at config load

        if self.model is None:
            raise RuntimeError("sync_weights(model) must come before generate()")
        copied = self.copy is not None and not sampling.greedy
        return generate_rollouts(self.sampler if copied else self.model, self.tok, rows, group_size,
                                 engine=self.mode, sampler_logp=copied, **sampling.__dict__)

    def close(self) -> None:
        self.model = self.sampler = None  # the policy is the trainer's; the copy goes with the engine
        if self.copy is not None:
            self.copy = Bf16Copy()


class Bf16Copy:
    """A bfloat16 copy of a module's parameters for sampling, for the shared-prefix decoder.

    Made at the first ``sync`` by a deep copy whose parameters are cast as they are copied (no
    second fp32 copy on the way; buffers such as the rotary frequencies stay float32, as
    transformers computes positions in float32), then refreshed in place at every ``sync`` (a
    cast copy per parameter, and a copy of each floating buffer). Made again if it is handed
    another module, or the module's parameters are no longer the same tensors of the same shapes
    and devices (a resized embedding, adapters attached). Not followed: a peft model's adapter
    switches (the trainer never changes them between rollouts). It pays on CPUs with bfloat16
    matmuls (figures: benchmarks/NOTES.md)."""

    def __init__(self):
        self.module, self.source, self.pairs, self.buffers, self.layout = None, None, [], [], []

    def sync(self, model):
        import torch

        params = list(model.parameters())
        if model is not self.source or [(id(p), p.shape, p.device) for p in params] != self.layout:
            self._make(model, params)
        with torch.no_grad():
            for src, dst in self.pairs + self.buffers:
                dst.copy_(src)
        return self.module

    def _make(self, model, params) -> None:
        import torch

        from grpo_core.rollout.decode import fast_decode_supported

        if not fast_decode_supported(model):
            raise ValueError(f"sampling.rollout_precision = 'bf16' samples with the shared-prefix decoder, which does "
                             f"not support {type(model).__name__}; set rollout_precision = 'fp32'")
        self.__init__()  # the old copy's memory first
        cast = {id(p): torch.nn.Parameter(p.detach().to(torch.bfloat16), requires_grad=False) for p in params}
        self.module = copy.deepcopy(model, memo=dict(cast)).eval()
        self.source, self.pairs = model, list(zip(params, self.module.parameters(), strict=True))
        if any(dst is not cast[id(src)] for src, dst in self.pairs):
            raise RuntimeError("the bf16 copy's parameters do not pair with the policy's")
        self.buffers = [(src, dst) for src, dst in zip(model.buffers(), self.module.buffers(), strict=True)
                        if src.is_floating_point()]
        self.layout = [(id(p), p.shape, p.device) for p in params]


def _vllm(tok, spec: EngineSpec):
    from grpo_core.rollout.vllm_engine import VllmEngine  # stdlib + torch: vLLM itself runs in its own venv

    return VllmEngine(tok, spec)


def _precision(spec: EngineSpec | None) -> str:
    return "fp32" if spec is None else spec.rollout_precision


ENGINES = {
    "auto": lambda tok, spec: InProcessEngine(tok, "auto", _precision(spec)),
    "decoder": lambda tok, spec: InProcessEngine(tok, "decoder", _precision(spec)),
    "generate": lambda tok, spec: InProcessEngine(tok, "generate", _precision(spec)),
    "vllm": _vllm,
}


def build(name: str, tok, config_or_spec=None) -> RolloutEngine:
    """The engine ``name`` names (a stage's ``rollout_engine`` or ``evaluate.engine``, validated
    against ``ENGINES`` at config load), from a stage's ``GRPOConfig`` or an ``EngineSpec`` (the
    vllm engine needs one; the in-process engines read its ``rollout_precision``, fp32 without one)."""
    c = config_or_spec
    spec = c if c is None or isinstance(c, EngineSpec) else EngineSpec.of_stage(c)
    return ENGINES[name](tok, spec)
