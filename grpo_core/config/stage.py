"""One typed, validated config per GRPO stage: ``GRPOConfig``, its top-level fields and one of each
group (``groups.py``).

Configuration flows one way: TOML file -> Metaflow ``Config`` -> ``PipelineConfig.from_dict``
(``pipeline.py``, parsed once per process) -> ``GRPOConfig`` per stage -> one JSON file per stage
-> parsed once per torchrun rank. Each field has its docstring once, right under it.
``from_dict`` rejects unknown fields and wrong types with a message naming the field, the allowed
names/values and the fix; ``__post_init__`` checks ranges and combinations. ``to_dict()`` is what
gets logged to MLflow, whole.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from grpo_core.config.checks import at_least, check_arithmetic, check_choice, from_dict, non_negative, require
from grpo_core.config.groups import (
    GROUPS,
    CheckpointSettings,
    ExecutionSettings,
    GateSettings,
    LoraSettings,
    LossSettings,
    OptimSettings,
    PoolSettings,
    SamplingSettings,
    StageRuntime,
    ValidationSettings,
    VllmSettings,
)
from grpo_core.data import tasks

SAMPLES_FILE = "samples_latest.json"  # in a stage's output_dir: the latest logged samples (replaced whole)
METRICS_FILE = "metrics.jsonl"  # in a stage's output_dir: one JSON line per iteration (trainer writes, pipeline reads)
DEFAULT_REWARDS = ({"fn": "grpo_core.data.rewards:gsm8k_correctness", "weight": 1.0},)
@dataclass
class GRPOConfig:
    """One GRPO stage (the curriculum and GSM8K stages each get one): what it trains on and for how
    long at the top level, the rest in groups (``GROUPS``), plus the flow's ``runtime`` record."""

    task: str = "arithmetic"
    """Training prompts: a task of ``grpo_core/data/tasks`` ('arithmetic': generated problems; 'gsm8k':
    its train split)."""
    gsm8k_source: str = "openai/gsm8k"
    """GSM8K hub id or a local dir with train.jsonl/test.jsonl (GSM8K_DIR overrides)."""
    gsm8k_max_steps: int = 0
    """Train on GSM8K problems whose reference solution takes at most this many calculator steps
    (``<<...>>`` annotations); 0 keeps every problem."""
    arithmetic_ops: str = "+-*"
    """Operators the arithmetic curriculum draws from."""
    arithmetic_min: int = 0
    """Smallest operand of the arithmetic curriculum."""
    arithmetic_max: int = 20
    """Largest operand of the arithmetic curriculum."""
    system_prompt: str | None = None
    """System message put before every prompt of this stage (rollouts, in-stage evaluation, and the
    final evaluation and served model of its checkpoint). None sends no system turn: the chat
    template's own default stays (SmolLM2 inserts "You are a helpful AI assistant named SmolLM,
    trained by Hugging Face"). No format instruction is added by default: rewards parse the answer
    from free text (``#### N``, ``<answer>N</answer>``, "the answer is N", else the last number)."""
    rewards: list = field(default_factory=lambda: [dict(r) for r in DEFAULT_REWARDS])
    """Reward functions: [{fn = 'package.module:function', weight = 1.0}] (code execution!)."""
    reward_timeout_s: float = 300.0
    """Seconds one reward function may take for one batch before the stage stops with an error
    naming it (a hung verifier would otherwise stall every rank forever); 0 disables the limit.
    Enforced with SIGALRM in the main thread: Python code and blocking system calls are
    interrupted, a C extension that never returns to Python is not."""
    iterations: int = 20
    """Rollout + update iterations in this stage (the most, if a promotion gate is set)."""
    prompts_per_iter: int = 16
    """Prompts per iteration across all ranks (must divide evenly across ranks)."""
    seed: int = 0
    """Seed for prompts, sampling and init; each iteration reseeds from (seed, iteration, rank)."""
    sample_every: int = 10
    """Log a table of sample completions every N iterations."""
    trust_remote_code: bool = False
    """Allow model code from the checkpoint; off unless you trust its source."""
    disable_dropout: bool = True
    """Zero the policy's and reference's dropout (as TRL's disable_dropout). With dropout on, sampling,
    old-policy scoring and the update each see a different random network: ratios, clipping and KL
    then measure dropout noise. Llama/Qwen2 have none; GPT-2-style checkpoints have 0.1."""
    sampling: SamplingSettings = field(default_factory=SamplingSettings)
    """Rollout sampling (``[<stage>.sampling]``)."""
    loss: LossSettings = field(default_factory=LossSettings)
    """The policy loss and advantages (``[<stage>.loss]``)."""
    optim: OptimSettings = field(default_factory=OptimSettings)
    """AdamW (``[<stage>.optim]``)."""
    execution: ExecutionSettings = field(default_factory=ExecutionSettings)
    """Precision, sharding, memory and time limits (``[<stage>.execution]``)."""
    validation: ValidationSettings = field(default_factory=ValidationSettings)
    """In-stage validation accuracy (``[<stage>.validation]``)."""
    gate: GateSettings = field(default_factory=GateSettings)
    """Promotion gate (``[<stage>.gate]``)."""
    pool: PoolSettings = field(default_factory=PoolSettings)
    """Difficulty-aware prompt selection (``[<stage>.pool]``)."""
    checkpoint: CheckpointSettings = field(default_factory=CheckpointSettings)
    """Checkpoint cadence and retention (``[<stage>.checkpoint]``)."""
    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA adapters instead of full fine-tuning (``[<stage>.lora]``)."""
    vllm: VllmSettings = field(default_factory=VllmSettings)
    """The vLLM server of rollout_engine = "vllm" (``[<stage>.vllm]``)."""
    runtime: StageRuntime = field(default_factory=StageRuntime)
    """Filled in by the flow (model, directories, MLflow run): not set in a stage table."""

    def __post_init__(self):
        for name, cls in {**GROUPS, "runtime": StageRuntime}.items():
            if isinstance(getattr(self, name), dict):  # built directly (tests, benchmarks), not from a table
                setattr(self, name, from_dict(cls, getattr(self, name), f"stage.{name}"))
        w = f"stage '{self.runtime.stage}'"
        check_choice(self.task, sorted(tasks.registry()), f"{w}.task")
        at_least(self, w, 1, "prompts_per_iter", "iterations", "sample_every")
        at_least(self, w, 0, "gsm8k_max_steps")
        non_negative(self, w, "reward_timeout_s")
        check_arithmetic(self.arithmetic_ops, self.arithmetic_min, self.arithmetic_max, w)
        for group in (self.sampling, self.loss, self.optim, self.execution, self.validation, self.pool,
                      self.checkpoint, self.vllm):
            group.check(w)
        self.gate.check(w, self.validation)
        self.lora.check(w, self.disable_dropout)
        if self.execution.parallelism == "fsdp2":
            require(not self.lora.rank, f"{w}.execution.parallelism", "'fsdp2' with LoRA (lora.rank > 0) is not "
                    "supported (LoRA's gradients and AdamW state are already small); use parallelism = 'ddp' "
                    "with LoRA, or lora.rank = 0 with fsdp2")
            require(not self.execution.compile_scoring, f"{w}.execution.parallelism", "'fsdp2' with "
                    "compile_scoring = true is not supported; set compile_scoring = false or parallelism = 'ddp'")
        if self.sampling.rollout_precision == "bf16":
            require(self.execution.precision == "fp32", f"{w}.sampling.rollout_precision", "'bf16' samples with a "
                    "bfloat16 copy of fp32 weights; execution.precision = 'bf16' already samples under bf16 "
                    "autocast: set one of them back to 'fp32'")
            require(self.execution.parallelism == "ddp", f"{w}.sampling.rollout_precision", "'bf16' with "
                    "parallelism = 'fsdp2' is not supported (the copy would hold every rank's full weights); "
                    "use parallelism = 'ddp' or rollout_precision = 'fp32'")
            mode = self.loss.rollout_is
            require(not mode.startswith("sequence"), f"{w}.loss.rollout_is", f"'{mode}' with "
                    "sampling.rollout_precision = 'bf16' learnt less in a measured curriculum than 'none' or fp32 "
                    "sampling (benchmarks/NOTES.md): per-sequence weights of a bf16 copy spread too widely; set "
                    "loss.rollout_is = 'none' (or a token_* mode)")
            require(not (self.lora.rank and self.lora.dropout), f"{w}.sampling.rollout_precision", "'bf16' samples "
                    "with the shared-prefix decoder, which runs no adapter dropout (lora.dropout > 0 samples with "
                    "generate): set lora.dropout = 0 or rollout_precision = 'fp32'")
        require(self.system_prompt is None or bool(self.system_prompt.strip()), f"{w}.system_prompt",
                "is empty; omit it to keep the chat template's default system message, or give the text")
        require(bool(self.rewards), f"{w}.rewards", "needs at least one {fn, weight} entry")
        for i, r in enumerate(self.rewards):
            require(isinstance(r, dict) and set(r) <= {"fn", "weight"} and "fn" in r,
                    f"{w}.rewards[{i}]", f"{r!r}: each entry is {{fn = 'pkg.mod:func', weight = 1.0}}")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def eval_max_new_tokens(self) -> int:
        """The in-stage validation's generation cap."""
        return self.validation.max_new_tokens or self.sampling.max_new_tokens

    def reads_validation(self) -> bool:
        """Whether the stage reads its task's validation split (periodic evaluation, or a gate)."""
        return bool(self.validation.every or self.gate.metric)

