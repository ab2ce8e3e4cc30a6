"""The TRL side of ``bench_grpo.py``: ``trl.GRPOTrainer`` on the same config as our trainer.

Called inside a worker subprocess (``run_trl``); returns one dict per optimizer step with the same
keys as our side. Timing is per step (``on_step_begin`` -> ``on_step_end``: generation, rewards,
reference log-probs, forward+backward+optimizer step); the split comes from wrapping TRL's own
methods: ``_generate_single_turn`` (HF generate), ``_calculate_rewards``, and the no-grad calls of
``_get_per_token_logps_and_entropies`` (reference / old log-probs). "fwd_bwd_step" is the rest.

Settings chosen to do the same work as our side (see bench_grpo.COMMON): beta 0.04 so the reference
model is loaded (from the model directory's path), ``use_bias_correction_kl=False`` (our k3 KL is not
multiplied by the ratio), dapo loss, group std, constant lr, 64 completions per step (one generation
and one optimizer step per batch: ``steps_per_generation=1``, ``num_iterations=1``).
"""
from __future__ import annotations

import tempfile
import time


def _timed(obj, name: str, acc: dict, key: str, only_no_grad: bool = False):
    import torch

    fn = getattr(obj, name)

    def wrapper(*a, **k):
        if only_no_grad and torch.is_grad_enabled():
            return fn(*a, **k)
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def _dataset(model_dir: str, n: int, seed: int, task: str = "arithmetic", task_params: dict | None = None):
    """The first ``n`` training prompts of ``task`` (read with ``task_params``) in the order our trainer draws them
    (``PromptStream(rows, seed)``: the same prompts, iteration by iteration, when TRL reads them
    unshuffled), rendered with the same chat template as our rollouts, and their gold answers
    (TRL hands every dataset column to the reward function, as our trainer hands it ``gold``)."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    from grpo_core.data import tasks
    from grpo_core.data.prompts import PromptStream
    from grpo_core.rollout.generate import render_prompts

    tok = AutoTokenizer.from_pretrained(model_dir)
    t = tasks.task(task)
    rows = PromptStream(t.rows("train", **t.resolve(dict(task_params or {}))), seed).take(0, n)
    prompts = render_prompts(tok, [r["prompt"] for r in rows])
    return Dataset.from_dict({"prompt": prompts, "gold": [r["gold"] for r in rows]}), tok


def _instrument(trainer, acc: dict, lengths: list[int], asked: list[str]) -> None:
    """Time TRL's generation, rewards and no-grad log-prob calls into ``acc``; record each
    generation's completion lengths and the digest of its prompts (``lockstep.prompts_digest``)."""
    from lockstep import prompts_digest

    _timed(trainer, "_generate_single_turn", acc, "generate")
    _timed(trainer, "_calculate_rewards", acc, "reward")
    _timed(trainer, "_get_per_token_logps_and_entropies", acc, "ref_old_logp", only_no_grad=True)
    gen = trainer._generate

    def counting_generate(prompts):
        out = gen(prompts)
        lengths.extend(len(c) for c in out[1])  # completion_ids, cut after EOS
        asked.append(prompts_digest(prompts))
        return out

    trainer._generate = counting_generate


def _trl_config(config_cls, spec: dict, common: dict, steps: int, torch_compile: bool):
    """TRL's GRPOConfig for one bench config. One generation of P x G completions and one optimizer
    step per step; ``spec["trl_micro_batch"]`` (completions per forward/backward, default all of
    them) splits the step into gradient-accumulation micro-batches, generated together
    (``steps_per_generation`` = accumulation steps, so TRL runs no old-log-prob forward);
    ``spec["trl_gradient_checkpointing"]`` turns on TRL's activation checkpointing."""
    G, P = spec["group_size"], spec["prompts"]
    micro = spec.get("trl_micro_batch") or G * P
    accumulate = G * P // micro
    return config_cls(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"), use_cpu=True, bf16=False, fp16=False,
        gradient_checkpointing=bool(spec.get("trl_gradient_checkpointing")), report_to="none", save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulate,
        num_generations=G, steps_per_generation=accumulate, num_iterations=1, max_steps=steps,
        max_completion_length=spec["max_new_tokens"], temperature=common["temperature"], top_k=common["top_k"],
        top_p=common["top_p"], beta=common["beta"], epsilon=common["clip"], learning_rate=common["lr"],
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=common["max_grad_norm"],
        loss_type=common["loss_type"], scale_rewards="group", use_bias_correction_kl=False,
        mask_truncated_completions=False, seed=common["seed"], dataloader_num_workers=0, log_completions=False,
        torch_compile=torch_compile, shuffle_dataset=False)  # our prompt order (``_dataset``)


def run_trl(spec: dict, common: dict, reward_fn: str, model_dir: str, iters: int, warmup: int,
            gate=None, emit=None, torch_compile: bool = False) -> list[dict]:
    """TRL's steps; ``gate()`` (if given) runs before each step's timer starts and ``emit(row)`` after
    the step (bench_grpo's lockstep protocol)."""
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_core.data.rewards import load_reward_fn
    from grpo_core.model.loading import prepare_tokenizer

    steps = iters + warmup
    dataset, tok = _dataset(model_dir, spec["prompts"] * (steps + 2), common["seed"], spec.get("task", "arithmetic"),
                            spec.get("task_params"))
    args = _trl_config(GRPOConfig, spec, common, steps, torch_compile)
    reward = load_reward_fn(reward_fn)
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=prepare_tokenizer(tok))
    assert trainer.ref_model is not None, "beta > 0 must load a reference model"

    acc = dict.fromkeys(("generate", "reward", "ref_old_logp"), 0.0)
    lengths: list[int] = []
    asked: list[str] = []  # this step's prompts digest (lockstep.prompts_digest)
    rows: list[dict] = []
    _instrument(trainer, acc, lengths, asked)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            if gate:
                gate()
            for k in acc:
                acc[k] = 0.0
            lengths.clear()
            asked.clear()
            self.t0, self.c0, self.w0 = time.perf_counter(), time.process_time(), time.time()

        def on_step_end(self, *_, **__):
            total = time.perf_counter() - self.t0
            rest = total - sum(acc.values())
            m = trainer._metrics["train"]
            rows.append({"total": total, "cpu": time.process_time() - self.c0, "wall": [self.w0, time.time()],
                         **acc, "fwd_bwd_step": rest,
                         "tokens": float(sum(lengths)),
                         "completions": len(lengths), "prompts": asked[0] if len(asked) == 1 else None,
                         "reward_mean": _last(m, "reward"),
                         "kl": _last(m, "kl")})
            if emit:
                emit(rows[-1])

    trainer.add_callback(StepTimer())
    torch.manual_seed(common["seed"])
    trainer.train()
    if len(rows) != steps:
        raise RuntimeError(f"TRL ran {len(rows)} steps, expected {steps}")
    return rows


def _last(metrics: dict, key: str):
    vals = metrics.get(key) or []
    return float(vals[-1]) if vals else None
