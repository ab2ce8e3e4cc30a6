"""The groups of a stage's config (``[<stage>.sampling]``, ``[<stage>.loss]``, ...) and their
vocabularies: each a typed dataclass whose fields carry their docstrings, and whose ``check``
validates ranges and combinations with messages naming the dotted field and the fix.
``GRPOConfig`` (``stage.py``) holds one of each."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from grpo_core.config.checks import at_least, check_choice, non_negative, positive, require

SCALES = ("group", "batch", "none")
SAMPLERS = ("inverse_cdf", "multinomial")
ROLLOUT_IS_MODES = ("sequence_mask", "sequence_truncate", "token_mask", "token_truncate", "none")  # = losses'
PRECISIONS = ("fp32", "bf16")
ROLLOUT_ENGINES = ("auto", "decoder", "generate", "vllm")  # = rollout.engines.ENGINES' keys
PARALLELISMS = ("ddp", "fsdp2")
TINY_ARCHITECTURES = ("llama", "qwen2")  # models.ARCHITECTURES (config cannot import torch)
FRACTION_METRICS = ("eval_accuracy", "informative_frac")  # gate metrics that never exceed 1
GATE_METRICS = ("eval_accuracy", "informative_frac", "reward")


def loss_type_names() -> tuple[str, ...]:
    """The loss entries' names. Imported when a stage config is validated, not at module load, so
    that parsing a config (the flow's command line) does not import torch."""
    from grpo_core.algo.losses import LOSS_TYPES

    return tuple(LOSS_TYPES)


@dataclass
class LoraSettings:
    """LoRA through peft (a stage's ``[<stage>.lora]`` table): rank 0 trains every weight."""

    rank: int = 0
    """Adapter rank r; 0 is full fine-tuning. With r > 0 only the adapters train (AdamW state for
    them alone) and the reference is the policy with its adapters off: no second copy of the model."""
    alpha: float = 16.0
    """LoRA alpha: the adapter's output is scaled by alpha / rank."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (needs disable_dropout = false: sampling,
    scoring and the update would otherwise see different random networks)."""
    target_modules: str | list = "all-linear"
    """Module names (or suffixes) that get adapters, as peft's ``target_modules``: "all-linear" is
    every linear layer except the LM head; e.g. ["q_proj", "v_proj"] for attention only."""

    def check(self, w: str, disable_dropout: bool) -> None:
        require(self.rank >= 0, f"{w}.lora.rank", f"must be >= 0 (0 = full fine-tuning), got {self.rank}")
        require(math.isfinite(self.alpha) and self.alpha > 0, f"{w}.lora.alpha", f"must be > 0, got {self.alpha}")
        require(0 <= self.dropout < 1, f"{w}.lora.dropout", f"must be in [0, 1), got {self.dropout}")
        require(not (self.dropout and disable_dropout), f"{w}.lora.dropout",
                f"{self.dropout} would be zeroed by disable_dropout = true; set disable_dropout = false to "
                "train with adapter dropout, or lora.dropout = 0")
        names = [self.target_modules] if isinstance(self.target_modules, str) else self.target_modules
        require(bool(names) and all(isinstance(n, str) and n for n in names), f"{w}.lora.target_modules",
                f"{self.target_modules!r}: give \"all-linear\" or a non-empty list of module names")


@dataclass
class SamplingSettings:
    """How rollouts are drawn (a stage's ``[<stage>.sampling]`` table)."""

    group_size: int = 8
    """G: completions sampled per prompt; the group's mean/std is the baseline."""
    temperature: float = 1.0
    """Sampling temperature; log-probs are scored at the same temperature."""
    top_p: float = 1.0
    """Nucleus filter; keep 1.0 so sampling matches the full-softmax log-probs."""
    top_k: int = 0
    """Top-k filter; 0 disables it (transformers' default of 50 would bias the loss)."""
    max_new_tokens: int = 32
    """Completion length cap; completions that hit it count as truncated."""
    max_prompt_tokens: int = 512
    """Prompts longer than this are an error naming the row (never silently cut)."""
    sampler: str = "inverse_cdf"
    """How the shared-prefix decoder draws a token: inverse_cdf (one uniform number per row, the
    faster) | multinomial (torch.multinomial, generate's: the same tokens as generate for a seed).
    Both draw from the same distribution; models on the generate fallback always use multinomial."""
    rollout_engine: str = "auto"
    """What samples the rollouts, one of ``ROLLOUT_ENGINES``: auto (the shared-prefix decoder
    where the model supports it, else transformers' generate) | decoder (insist on the decoder) |
    generate (always generate) | vllm (a vLLM server from its own environment: ``[<stage>.vllm]``)."""
    rollout_precision: str = "fp32"
    """The weights the in-process engines (auto, decoder) sample with: fp32 (the policy's own) |
    bf16 (a bfloat16 copy of the policy's parameters, refreshed before every rollout; buffers such
    as the rotary frequencies stay float32): faster decoding on a CPU with bfloat16 matmuls
    (avx512_bf16, AMX). The samples then come from a rounded policy, so the engine returns its
    log-probs of its samples and ``loss.rollout_is`` corrects the gap as for vllm. Per-sequence
    weights of a bf16 copy spread too widely to learn with, so sequence_* modes are refused with
    bf16: set loss.rollout_is = "none" or a token_* mode (speed, gap and the learning check that
    found this: benchmarks/NOTES.md, "Sampling from a bfloat16 copy"). Greedy
    decoding (in-stage validation, which gates read, and the final evaluation) uses the policy
    itself, so accuracies do not depend on this option. Needs rollout_engine auto or decoder on a
    model the decoder supports, execution.precision fp32 and parallelism ddp."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop all-equal groups and draw more prompts to refill."""
    max_resample_rounds: int = 3
    """Cap on extra sampling rounds per iteration with dynamic sampling."""

    def check(self, w: str) -> None:
        w = f"{w}.sampling"
        check_choice(self.sampler, SAMPLERS, f"{w}.sampler")
        check_choice(self.rollout_engine, ROLLOUT_ENGINES, f"{w}.rollout_engine")
        check_choice(self.rollout_precision, PRECISIONS, f"{w}.rollout_precision")
        require(self.rollout_precision == "fp32" or self.rollout_engine in ("auto", "decoder"),
                f"{w}.rollout_precision", f"'bf16' is the in-process decoder's bfloat16 copy, which rollout_engine "
                f"'{self.rollout_engine}' does not use: set rollout_engine = 'decoder' (or 'auto'), or "
                "rollout_precision = 'fp32' (vllm serves the dtype execution.precision names)")
        require(self.group_size >= 2, f"{w}.group_size", f"{self.group_size} < 2: a group needs at least "
                "two samples for a baseline; set group_size >= 2")
        at_least(self, w, 1, "max_new_tokens", "max_prompt_tokens")
        at_least(self, w, 0, "top_k", "max_resample_rounds")
        positive(self, w, "temperature", "top_p")
        require(self.top_p <= 1.0, f"{w}.top_p", f"must be <= 1.0, got {self.top_p}")


@dataclass
class LossSettings:
    """The policy loss and its advantages (a stage's ``[<stage>.loss]`` table)."""

    type: str = "dapo"
    """The policy loss, one entry of `losses.LOSS_TYPES`: grpo | bnpo | dapo | dr_grpo (PPO clip per
    token, four aggregations), gspo (one clipped ratio per sequence), cispo (clipped, detached IS
    weight per token). docs/objective.md has each one's formula and paper."""
    beta: float = 0.04
    """KL coefficient (k3 estimator, per token); 0 skips the reference model entirely."""
    clip_low: float = 0.2
    """Clip epsilon below 1 (the ratio's lower bound is 1 - clip_low; for cispo, the IS weight's)."""
    clip_high: float | None = None
    """Clip epsilon above 1 (DAPO clip-higher); None means clip_low."""
    scale: str = "group"
    """Advantage scale: group std | batch std | none (Dr. GRPO)."""
    adv_eps: float = 1e-4
    """Epsilon added to the std in the advantage denominator."""
    mask_truncated: bool = False
    """Exclude completions that hit sampling.max_new_tokens from the loss."""
    rollout_is: str = "sequence_mask"
    """Importance sampling between the trainer's policy and an engine that samples with its own copy
    (vllm, or sampling.rollout_precision = "bf16"): r = exp(old_logp - sampler_logp) per token
    (token_*) or of the sum over the sequence (sequence_*); truncate caps r at rollout_is_cap,
    mask zeroes it above the cap; the policy term is multiplied by r (detached). none: measure
    only. In-process engines in fp32 sample with the trained weights themselves: no correction
    (r = 1)."""
    rollout_is_cap: float = 3.0
    """The importance ratio's cap (TRL's vllm_importance_sampling_cap)."""

    def check(self, w: str) -> None:
        w = f"{w}.loss"
        check_choice(self.rollout_is, ROLLOUT_IS_MODES, f"{w}.rollout_is")
        require(math.isfinite(self.rollout_is_cap) and self.rollout_is_cap >= 1, f"{w}.rollout_is_cap",
                f"must be a finite number >= 1, got {self.rollout_is_cap}")
        check_choice(self.type, loss_type_names(), f"{w}.type")
        check_choice(self.scale, SCALES, f"{w}.scale")
        non_negative(self, w, "beta", "clip_low", "adv_eps")
        require(self.clip_high is None or (math.isfinite(self.clip_high) and self.clip_high >= 0),
                f"{w}.clip_high", f"must be a finite number >= 0 or omitted (= clip_low), got {self.clip_high}")


@dataclass
class OptimSettings:
    """AdamW and how often it steps per rollout batch (a stage's ``[<stage>.optim]`` table)."""

    lr: float = 1e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_iters: int = 0
    """Linear learning-rate warm-up iterations (iterations, not optimizer steps: with mu > 1 every
    update of an iteration uses that iteration's rate)."""
    max_grad_norm: float = 1.0
    """Gradient clipping norm (0 disables clipping)."""
    mu: int = 1
    """Updates per rollout batch; 1 is on-policy (old log-probs = detached current ones)."""

    def check(self, w: str) -> None:
        w = f"{w}.optim"
        positive(self, w, "lr")
        non_negative(self, w, "weight_decay", "max_grad_norm")
        at_least(self, w, 0, "warmup_iters")
        require(self.mu >= 1, f"{w}.mu", f"must be >= 1 (updates per rollout batch), got {self.mu}")


@dataclass
class ExecutionSettings:
    """How the stage runs on its hardware: precision, sharding, memory and time limits (a stage's
    ``[<stage>.execution]`` table). None of these changes what is optimised."""

    precision: str = "fp32"
    """Matmul precision of rollouts, scoring, the update and in-stage evaluation: fp32 | bf16
    (torch.autocast to bfloat16 with float32 weights, AdamW state, log-softmax and loss math:
    TRL/accelerate's ``bf16=True``). bf16 is for GPUs with bfloat16 tensor cores (A100, H100, ...);
    on CPU the weight casts and bf16 attention eat most of the gain, the update's all of it
    (benchmarks/NOTES.md; sampling.rollout_precision = "bf16" speeds the rollouts alone). Sampling and
    scoring then both see bf16 logits (~1e-2 from fp32's); the on-policy ratio is still exactly 1
    (mu = 1)."""
    parallelism: str = "ddp"
    """How a multi-rank stage holds the policy: ddp (a full copy of weights, gradients and AdamW
    state on every rank) | fsdp2 (``fully_shard`` per decoder layer plus the root: each rank holds
    1/world of them; full weights are gathered for each rollout). fsdp2 needs >= 2 ranks and full
    fine-tuning (not LoRA); its checkpoints are sharded (torch.distributed.checkpoint) and resume
    on the same number of ranks."""
    micro_batch_groups: int = 0
    """Groups per forward/backward in the update (gradient accumulation within a rank's batch):
    bounds activation memory by this many groups instead of the rank's whole batch, with the same
    gradient (up to float rounding) and one optimizer step. 0: all of the rank's groups at once."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations during backward (non-reentrant): the update keeps
    each layer's input instead of all its activations, for about one more forward of compute.
    Packed scoring (Llama/Qwen2-style models not sharded by FSDP2) checkpoints its own layer loop
    and still runs each group's prompt once; otherwise transformers' gradient checkpointing runs
    the model's forward over prompt and completion together (as TRL does), since a layer replayed
    in backward cannot share the prompt's KV cache. Sampling and the reference are unchanged."""
    compile_scoring: bool = False
    """torch.compile (dynamic shapes) the policy and reference forwards that score completions for
    the loss (not the decoder). Pays on long runs only: the first iterations compile, in every
    training process (figures: benchmarks/NOTES.md)."""
    collective_timeout_s: float = 1800.0
    """Seconds a rank waits for the others in one collective before the stage fails (instead of
    hanging). Rank 0 alone saves and uploads checkpoints, and downloads the one to resume from,
    while the other ranks wait in a barrier, so this must exceed the slowest such transfer.
    torch's own defaults are 30 min on gloo but 10 min on nccl, shorter than a large model's
    checkpoint upload to S3; this applies the same limit to both."""

    def check(self, w: str) -> None:
        w = f"{w}.execution"
        check_choice(self.precision, PRECISIONS, f"{w}.precision")
        check_choice(self.parallelism, PARALLELISMS, f"{w}.parallelism")
        require(self.micro_batch_groups >= 0, f"{w}.micro_batch_groups",
                f"must be >= 0 (0 = all of a rank's groups at once), got {self.micro_batch_groups}")
        positive(self, w, "collective_timeout_s")


@dataclass
class VllmSettings:
    """The vLLM server of ``sampling.rollout_engine = "vllm"`` (a stage's ``[<stage>.vllm]`` table),
    and of ``[evaluate] engine = "vllm"`` (``[evaluate.vllm]``). A stage's server takes its dtype
    from execution.precision (fp32: float32, bf16: bfloat16); the evaluation's serves fp32."""

    python: str = ""
    """vLLM's environment: a venv directory or its python; empty: the repo's .vllm-venv (built by
    infra/vllm-env.sh)."""
    port: int = 0
    """Port on 127.0.0.1; 0: a free one."""
    startup_timeout_s: float = 300.0
    """Seconds the server may take to answer /health before the stage fails with its log."""
    request_timeout_s: float = 600.0
    """Seconds one completion request or weight reload may take."""
    kv_cache_memory_bytes: int = 1 << 30
    """KV-cache size; 0: vLLM sizes it from gpu_memory_utilization (a GPU). On CPU set it: vLLM's
    default share of the node's RAM fails its start-up check on small machines."""
    gpu_memory_utilization: float = 0.3
    """Share of the GPU's memory vLLM may take (weights and KV cache) when kv_cache_memory_bytes is 0;
    the trainer holds the rest."""
    max_model_len: int = 0
    """Longest sequence served; 0: the longest prompt plus the largest generation cap asked for
    (a stage: sampling.max_prompt_tokens and its caps; the evaluation: evaluate.max_prompt_tokens
    and its sets' caps)."""
    extra_args: list = field(default_factory=list)
    """More `vllm serve` arguments, e.g. ["--max-num-seqs", "64"]."""

    def check(self, w: str) -> None:
        w = f"{w}.vllm"
        require(0 <= self.port < 65536, f"{w}.port", f"must be in 0..65535 (0: a free port), got {self.port}")
        positive(self, w, "startup_timeout_s", "request_timeout_s")
        at_least(self, w, 0, "kv_cache_memory_bytes", "max_model_len")
        require(0 < self.gpu_memory_utilization <= 1, f"{w}.gpu_memory_utilization",
                f"must be in (0, 1], got {self.gpu_memory_utilization}")
        require(all(isinstance(a, str) for a in self.extra_args), f"{w}.extra_args",
                f"{self.extra_args!r}: give a list of strings")


@dataclass
class ValidationSettings:
    """Greedy accuracy on the task's validation split during the stage (``[<stage>.validation]``).
    Validation is disjoint from training and from the test items the final evaluation reports
    (``grpo_core.data.tasks``)."""

    every: int = 0
    """Measure every N iterations and at the end; 0: never (unless the gate reads
    ``eval_accuracy``). It is the gate's ``eval_accuracy``."""
    size: int = 100
    """Validation items measured."""
    max_new_tokens: int = 0
    """Generation cap; 0 means sampling.max_new_tokens."""

    def check(self, w: str) -> None:
        at_least(self, f"{w}.validation", 1, "size")
        at_least(self, f"{w}.validation", 0, "every", "max_new_tokens")


@dataclass
class GateSettings:
    """Promotion gate: stop the stage early once a metric is good enough (``[<stage>.gate]``)."""

    metric: str | None = None
    """eval_accuracy | informative_frac | reward; unset: no gate, the stage runs all iterations."""
    threshold: float = 1.0
    """The value the metric must reach."""
    patience: int = 1
    """Consecutive measurements at or above the threshold needed to promote."""

    def check(self, w: str, validation: ValidationSettings) -> None:
        w = f"{w}.gate"
        at_least(self, w, 1, "patience")
        require(math.isfinite(self.threshold), f"{w}.threshold",
                f"must be a finite number, got {self.threshold} (leave gate.metric unset for no gate)")
        if self.metric is None:
            return
        check_choice(self.metric, GATE_METRICS, f"{w}.metric")
        require(self.metric != "eval_accuracy" or validation.every > 0, f"{w}.metric",
                "'eval_accuracy' is measured only with validation.every > 0; set validation.every")
        require(self.metric not in FRACTION_METRICS or self.threshold <= 1, f"{w}.threshold",
                f"{self.threshold} can never be reached: {self.metric} is a fraction (at most 1), so "
                "the gate would never promote; use a threshold in [0, 1]")


@dataclass
class PoolSettings:
    """Difficulty-aware prompt selection (``[<stage>.pool]``; ``grpo_core/data/pool.py``): each
    prompt's pass rate is recorded, solved prompts retire, prompts that keep failing rest, and part
    of each batch replays prompts whose last group was informative."""

    enabled: bool = False
    """Select prompts through the pool; false draws the stage's prompt stream as it comes."""
    pass_reward: float = 1.0
    """A sample passes when its total reward is at least this (1.0: a right answer under the
    default correctness reward)."""
    retire_solved: bool = True
    """A group whose samples all passed retires its prompt for the rest of the stage."""
    rest_after: int = 1
    """All-failed groups in a row after which a prompt rests."""
    rest_iterations: int = 20
    """Iterations a resting prompt sits out."""
    replay_share: float = 0.0
    """Up to this share of each batch re-draws prompts whose last group was informative (least
    recently seen first); the rest are fresh prompts from the stream."""

    def check(self, w: str) -> None:
        w = f"{w}.pool"
        at_least(self, w, 1, "rest_after", "rest_iterations")
        require(math.isfinite(self.pass_reward), f"{w}.pass_reward", f"must be a finite number, got {self.pass_reward}")
        require(0.0 <= self.replay_share <= 1.0, f"{w}.replay_share",
                f"must be in [0, 1] (a share of each batch), got {self.replay_share}")


@dataclass
class CheckpointSettings:
    """How often the stage checkpoints, and how many it keeps (``[<stage>.checkpoint]``)."""

    every: int = 10
    """Checkpoint (and flush metrics to MLflow) every N iterations."""
    keep: int = 2
    """Complete checkpoints kept; older ones are deleted after a new one is verified."""

    def check(self, w: str) -> None:
        at_least(self, f"{w}.checkpoint", 1, "every", "keep")


@dataclass
class StageRuntime:
    """What the flow fills in for each stage run; a stage table does not set these."""

    model: str = ""
    """Starting policy: hub id, local HF dir or s3:// URI."""
    stage: str = "grpo"
    """Stage name: used for metric prefixes, output dirs and MLflow child runs."""
    output_dir: str = "outputs/grpo"
    """Local working directory: metrics.jsonl, checkpoints, final model."""
    sync_uri: str | None = None
    """Storage URI (dir or s3://) where checkpoints and the final model are published."""
    resume_from: list = field(default_factory=list)
    """Storage URIs searched, in order, for the latest complete checkpoint to resume from."""
    tracking_uri: str | None = None
    """MLflow tracking URI (rank 0 logs there)."""
    tracking_run_id: str | None = None
    """MLflow run id to log into (the stage's child run)."""


GROUPS = {"sampling": SamplingSettings, "loss": LossSettings, "optim": OptimSettings,
          "execution": ExecutionSettings, "validation": ValidationSettings, "gate": GateSettings,
          "pool": PoolSettings, "checkpoint": CheckpointSettings, "lora": LoraSettings, "vllm": VllmSettings}
"""A stage's sub-tables, in the order the configuration reference lists them."""
