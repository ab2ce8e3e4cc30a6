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

The in-process engines sample with the policy module itself, so syncing only records the module.
The ``vllm`` engine (``grpo_core.rollout.vllm_engine``) samples with a vLLM server of its own environment,
so syncing sends it the weights; it also returns the sampled tokens' log-probs
(``RolloutBatch.sampler_logp``), which the loss uses to correct the rollout/trainer mismatch.
Adding an engine is one class with these two methods (and ``close``) plus its ``ENGINES`` entry,
a factory of ``(tok, spec)`` (``EngineSpec``: what an engine may need beyond the tokenizer, taken
from a stage's config or from the evaluation's), and its name in the config's ``ROLLOUT_ENGINES``
(the vocabulary a config file may use, validated at load; a test holds the two lists equal).
"""
from __future__ import annotations

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
    """What an engine may need beyond the tokenizer. In-process engines need none of it; the vllm
    engine starts its server from it. Built from a stage's config (``of_stage``) or by the
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

    @classmethod
    def of_stage(cls, cfg) -> EngineSpec:
        """A GRPO stage's: its vLLM table, precision and seed; the longest sequence its rollouts
        or its validation ask for; logs beside its checkpoints."""
        s = cfg.sampling
        return cls(cfg.vllm, cfg.execution.precision,
                   s.max_prompt_tokens + max(s.max_new_tokens, cfg.eval_max_new_tokens()), cfg.seed,
                   str(Path(cfg.runtime.output_dir)), f"{cfg.runtime.stage}.vllm" if cfg.runtime.stage else "vllm")


class RolloutEngine(Protocol):
    def sync_weights(self, model) -> None:
        """Take the policy's current weights; called before every rollout."""

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        """``group_size`` completions of every row (each a dict with ``prompt`` plus dataset
        columns), group-contiguous, with the rows' columns repeated per completion."""


class InProcessEngine:
    """Samples with the policy module itself. ``mode``: "auto" (the shared-prefix decoder where
    ``decode.fast_decode_supported``, else transformers' ``generate``), "decoder" (insist on the
    decoder) or "generate" (always ``generate``)."""

    def __init__(self, tok, mode: str = "auto"):
        self.tok, self.mode, self.model = tok, mode, None

    def sync_weights(self, model) -> None:
        self.model = model  # the same module: nothing to copy

    def generate(self, rows: list[dict], group_size: int, sampling: Sampling) -> RolloutBatch:
        from grpo_core.rollout.generate import generate_rollouts  # transformers: not at config load

        if self.model is None:
            raise RuntimeError("sync_weights(model) must come before generate()")
        return generate_rollouts(self.model, self.tok, rows, group_size, engine=self.mode, **sampling.__dict__)

    def close(self) -> None:
        pass  # nothing held but the policy, which is the trainer's


def _vllm(tok, spec: EngineSpec):
    from grpo_core.rollout.vllm_engine import VllmEngine  # stdlib + torch: vLLM itself runs in its own venv

    return VllmEngine(tok, spec)


ENGINES = {
    "auto": lambda tok, spec: InProcessEngine(tok, "auto"),
    "decoder": lambda tok, spec: InProcessEngine(tok, "decoder"),
    "generate": lambda tok, spec: InProcessEngine(tok, "generate"),
    "vllm": _vllm,
}


def build(name: str, tok, config_or_spec=None) -> RolloutEngine:
    """The engine ``name`` names (a stage's ``rollout_engine`` or ``evaluate.engine``, validated
    against ``ENGINES`` at config load), from a stage's ``GRPOConfig`` or an ``EngineSpec`` (the
    vllm engine needs one; in-process engines ignore it)."""
    c = config_or_spec
    spec = c if c is None or isinstance(c, EngineSpec) else EngineSpec.of_stage(c)
    return ENGINES[name](tok, spec)
