"""The GRPO loop for one stage: rollouts -> rewards -> advantages -> clipped update + k3 KL.

Each iteration reseeds from (seed, iteration, rank) and draws its prompts from a deterministic
stream position, so a stage restarted from its latest checkpoint produces bitwise the same
weights as an uninterrupted run. Prompts are sharded across ranks by whole groups; metrics are
all-reduced; only rank 0 writes files and talks to MLflow. Metrics reach MLflow at checkpoint
commit points (and at the end): a crashed stage that resumes never logs a step twice.
"""
from __future__ import annotations

import json
import math
import random
import time
import warnings
from pathlib import Path

import torch

from grpo_core.algo.core import group_advantages, informative_mask, masked_mean, std_from_moments
from grpo_core.algo.losses import grpo_loss, micro_batch_weight, rollout_is_weights
from grpo_core.algo.objective import objective_card
from grpo_core.config.checks import ConfigError
from grpo_core.data import tasks
from grpo_core.data.pool import PromptPool
from grpo_core.data.prompts import PromptStream, eval_rows, train_rows
from grpo_core.data.rewards import RewardSpec, combine_rewards, resolve_specs
from grpo_core.evaluation.greedy import greedy_results
from grpo_core.io import storage
from grpo_core.policy import dist
from grpo_core.policy.policy import Policy
from grpo_core.rollout import engines
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.generate import render_prompts
from grpo_core.train.gate import PromotionGate
from grpo_core.train.iteration_metrics import (
    MISMATCH_MAXES,
    MISMATCH_SUMS,
    add_mismatch,
    iteration_metrics,
    local_sums,
    mismatch_metrics,
    new_mismatch,
)
from grpo_core.train.metrics_recorder import MetricsRecorder
from grpo_core.train.stage_checkpoints import StageCheckpoints
from grpo_core.train.update_stats import MergedStats

MAX_NONFINITE_IN_A_ROW = 3  # consecutive skipped updates before the stage stops with an error


class NonFiniteError(RuntimeError):
    pass


def iteration_seed(seed: int, iteration: int, rank: int) -> int:
    return (seed * 1_000_003 + iteration * 7_919 + rank * 104_729) % (2**63 - 1)


TIMED_PHASES = ("time_generate", "time_reward", "time_ref", "time_update")


class Trainer:
    def __init__(self, cfg, info: dist.DistInfo):
        self.cfg, self.info = cfg, info
        if cfg.prompts_per_iter % info.world_size:  # _shard would drop the remainder every iteration
            raise ConfigError(f"stage '{cfg.runtime.stage}'.prompts_per_iter: {cfg.prompts_per_iter} prompts cannot "
                              f"be split across {info.world_size} ranks; use a multiple of {info.world_size}")
        self.out = Path(cfg.runtime.output_dir)
        torch.manual_seed(cfg.seed)
        self.policy = Policy(cfg, info)
        self.opt = self.policy.optimizer()
        self.sched = self._schedule()
        self.rewards = resolve_specs([RewardSpec(**r) for r in cfg.rewards])
        self.engine = engines.build(cfg.sampling.rollout_engine, self.policy.tok, cfg)
        self.sampling = engines.Sampling.of(cfg)
        self.stream = PromptStream(train_rows(cfg), cfg.seed)
        self.pool = PromptPool(cfg.pool, self.stream) if cfg.pool.enabled else None
        self.eval_rows = eval_rows(cfg, cfg.validation.size) if cfg.reads_validation() else None
        self.gate = PromotionGate.from_config(cfg)
        self.state = {"iteration": 0, "data_position": 0, "nonfinite_in_a_row": 0,
                      "skipped_updates": 0, "history": [], **self.gate.state_dict(),
                      **(self.pool.state_dict() if self.pool else {})}
        self.timings = dict.fromkeys(TIMED_PHASES, 0.0)  # seconds per phase of the current iteration
        self.checkpoints = StageCheckpoints(cfg, info, self.out)
        self.recorder = MetricsRecorder(cfg, info.is_main, info.rank, self.out)

    # ---------------------------------------------------------------- resume and checkpoints
    def resume(self) -> int:
        """Continue from the newest verified checkpoint (local, this run's or the origin's); the
        iteration it was written at, 0 when there is none."""
        path = self.checkpoints.find_latest()
        if path is None:
            return 0
        self.state = self.checkpoints.load(path, self.policy.model, self.opt, self.sched,
                                           read_shards=self.policy.shard_reader(self.opt))
        self.gate.load_state_dict(self.state)
        if self.pool is not None:
            self.pool.load_state_dict(self.state)
        self.sched = self._schedule(done_iterations=self.state["iteration"])
        self.recorder.restore(path, self.state["iteration"])
        self.checkpoints.republish(path, self.state["iteration"])
        dist.print0(f"[{self.cfg.runtime.stage}] resumed from {path} at iteration {self.state['iteration']}")
        return self.state["iteration"]

    def _schedule(self, done_iterations: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warm-up over ``warmup_iters`` iterations, positioned at the iterations done (the
        schedule advances once per iteration, whatever mu is)."""
        warm = max(self.cfg.optim.warmup_iters, 0)
        return torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda it: min(1.0, (it + 1) / warm) if warm else 1.0, last_epoch=done_iterations - 1)

    def save_checkpoint(self, iteration: int) -> None:
        """A commit point: the checkpoint (rank 0), then the metrics up to it; all ranks wait."""
        self.state.update(self.gate.state_dict(), **(self.pool.state_dict() if self.pool else {}))
        self.checkpoints.save(iteration, self.policy.model, self.opt, self.sched, self.state,
                              self.recorder.checkpoint_files(), write_shards=self.policy.shard_writer(self.opt))
        self.recorder.commit()
        dist.barrier()

    # ---------------------------------------------------------------- one iteration
    def _shard(self, rows: list[dict]) -> list[dict]:
        per = len(rows) // self.info.world_size
        return rows[self.info.rank * per:(self.info.rank + 1) * per]

    def _draw(self, n_prompts: int, drawn: set[str], roll: dict) -> list[dict]:
        """The iteration's next ``n_prompts`` rows (all ranks': the same on every rank): through
        the pool when it is on, else the stream's next ones."""
        position = self.state["data_position"]
        if self.pool is None:
            rows = self.stream.take(position, n_prompts)
            self.state["data_position"] += n_prompts
        else:
            rows, self.state["data_position"], replayed = self.pool.select(
                position, n_prompts, self.state["iteration"] + 1, drawn)
            roll["replayed_prompts"] = roll.get("replayed_prompts", 0) + replayed
        drawn.update(r["id"] for r in rows)
        return rows

    def _observe(self, rows: list[dict], batch: RolloutBatch) -> None:
        """Every rank's groups into the pool: the same pool state on every rank."""
        G, per = self.cfg.sampling.group_size, len(rows) // self.info.world_size
        passed = [0.0] * len(rows)
        mine = (batch.rewards.view(-1, G) >= self.cfg.pool.pass_reward).sum(1).tolist()
        passed[self.info.rank * per:self.info.rank * per + len(mine)] = [float(x) for x in mine]
        if dist.active():
            passed = dist.all_reduce_sum(passed, self.info.device)
        self.pool.observe([r["id"] for r in rows], [round(x) for x in passed], G, self.state["iteration"] + 1)

    def _sample(self, n_prompts: int, drawn: set[str], roll: dict) -> RolloutBatch:
        c = self.cfg
        everyone = self._draw(n_prompts, drawn, roll)
        rows = self._shard(everyone)
        with self.policy.synced(self.engine):
            batch = self.engine.generate(rows, c.sampling.group_size, self.sampling)
        t0 = time.perf_counter()
        total, parts = combine_rewards(self.rewards, batch.prompts, batch.completions, batch.reward_columns(),
                                       timeout_s=c.reward_timeout_s)
        batch.rewards = torch.tensor(total, dtype=torch.float32)
        self.reward_names = list(parts)  # the same functions, in the same order, every call
        batch.reward_parts = torch.tensor([parts[k] for k in self.reward_names],
                                          dtype=torch.float64).reshape(len(parts), len(batch)).T
        if self.pool is not None:
            self._observe(everyone, batch)
        self.timings["time_reward"] += time.perf_counter() - t0
        return batch

    def rollout(self) -> tuple[RolloutBatch, dict]:
        """Sample, score, and (with dynamic sampling) refill until enough groups are informative."""
        c, G = self.cfg, self.cfg.sampling.group_size
        t0, seen, stats = time.perf_counter(), set(), {}
        batch = self._sample(c.prompts_per_iter, seen, stats)
        drawn, informative_first = len(batch) // G, informative_mask(batch.rewards, G)
        stats.update(informative_groups=informative_first.float().sum().item(), drawn_groups=drawn)
        if c.sampling.dynamic_sampling:
            kept, rounds = [batch.select_groups(informative_first)], 0
            need = lambda: dist.all_reduce_max(float(sum(b.num_groups for b in kept) < drawn))  # noqa: E731
            while rounds < c.sampling.max_resample_rounds and need() > 0:
                extra = self._sample(c.prompts_per_iter, seen, stats)
                kept.append(extra.select_groups(informative_mask(extra.rewards, G)))
                rounds += 1
            n_groups = min(sum(b.num_groups for b in kept), drawn)
            if n_groups:
                pool = RolloutBatch.concat([b for b in kept if len(b)], self.policy.tok.pad_token_id)
                batch = pool.select_groups(torch.arange(pool.num_groups) < n_groups)
            else:  # nothing informative on this rank: it still runs the update (DDP) but adds nothing
                batch.loss_rows = torch.zeros(len(batch), dtype=torch.bool)
            stats.update(dynamic_rounds=rounds, dynamic_drawn=drawn * (rounds + 1))
        batch.advantages = self.advantages(batch.rewards, batch.loss_rows)
        self.timings["time_generate"] += time.perf_counter() - t0 - self.timings["time_reward"]
        return batch, stats

    def advantages(self, rewards: torch.Tensor, loss_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Group-relative advantages of this rank's groups; scale="batch" divides by the std of
        the global batch (all ranks' rewards of rows in the loss), so the update does not depend
        on how it is split."""
        c, batch_std = self.cfg, None
        if c.loss.scale == "batch" and dist.active():
            r = rewards.double() if loss_rows is None else rewards.double()[loss_rows]
            batch_std = std_from_moments(*dist.all_reduce_sum(
                [r.sum().item(), (r * r).sum().item(), r.numel()], self.info.device))
        return group_advantages(rewards, c.sampling.group_size, scale=c.loss.scale, eps=c.loss.adv_eps,
                                batch_std=batch_std)

    def update(self, batch: RolloutBatch) -> dict:
        """mu clipped updates on one rollout batch, each one optimizer step over the rank's
        micro-batches of ``micro_batch_groups`` groups (gradients accumulated; DDP all-reduces
        once, after the last). The learning-rate schedule advances once per call (iteration),
        whatever mu is and whether or not a step was skipped."""
        stats = {**self._update(batch), "lr": self.sched.get_last_lr()[0]}  # the rate this iteration used
        with warnings.catch_warnings():  # an iteration with nothing to learn steps the schedule alone
            warnings.filterwarnings("ignore", r"Detected call of `lr_scheduler\.step\(\)` before", UserWarning)
            self.sched.step()
        return stats

    def _update(self, batch: RolloutBatch) -> dict:
        c, dev = self.cfg, self.info.device
        mask = batch.completion_mask.clone()                                    # [B, T]
        if c.loss.mask_truncated:
            mask &= ~batch.truncated.unsqueeze(1)
        rows = batch.loss_rows if batch.loss_rows is not None else torch.ones(len(batch), dtype=torch.bool)
        mask &= rows.unsqueeze(1)
        # one collective: the loss normalisers over all ranks, so no rank's share depends on the split
        global_tokens, global_rows = dist.all_reduce_sum([float(mask.sum()), float(rows.sum())], dev)
        if global_tokens == 0:  # nothing to learn anywhere (e.g. every completion masked): no step
            return {**MergedStats().result(), "grad_norm": 0.0}
        parts = batch.split_groups(c.execution.micro_batch_groups)
        masks = [mask] if len(parts) == 1 else list(mask.split([len(p) for p in parts]))
        t0, policy, temperature = time.perf_counter(), self.policy, c.sampling.temperature
        if policy.has_reference:
            for part, logp in zip(parts, policy.reference_logprobs(parts, temperature)):
                part.ref_logp = logp
        if c.optim.mu > 1:
            for part, logp in zip(parts, policy.old_logprobs(parts, temperature)):
                part.old_logp = logp
        self.timings["time_ref"] += time.perf_counter() - t0
        # fsdp2: each layer call is a collective, so every rank runs as many micro-batches as the
        # rank with the most; the extra ones repeat the first with a zero loss (no gradient, no stats)
        n_parts = int(dist.all_reduce_max(float(len(parts)), dev)) if policy.sharded else len(parts)
        self.mismatch = new_mismatch()
        for epoch in range(c.optim.mu):
            self.opt.zero_grad(set_to_none=True)
            merged = MergedStats()
            for k in range(n_parts):
                pad = k >= len(parts)
                part, pmask = (parts[0], masks[0]) if pad else (parts[k], masks[k])
                with policy.accumulating(k < len(parts) - 1):
                    logp, ent = policy.logprobs(part, temperature)
                    old = part.old_logp if part.old_logp is not None else logp.detach()
                    is_weight = self._is_weight(old, part, pmask, record=epoch == 0 and not pad)
                    loss, stats = grpo_loss(
                        logp, old.to(dev), None if part.ref_logp is None else part.ref_logp.to(dev),
                        part.advantages.to(dev), pmask.to(dev), clip_low=c.loss.clip_low, clip_high=c.loss.clip_high,
                        beta=c.loss.beta, loss_type=c.loss.type, max_completion_length=c.sampling.max_new_tokens,
                        global_token_count=global_tokens, global_sequence_count=global_rows,
                        world_size=self.info.world_size, is_weight=is_weight)
                    weight = 1.0 if len(parts) == 1 else micro_batch_weight(
                        c.loss.type, len(part), len(batch), float(pmask.sum()), float(mask.sum()))
                    if weight != 1.0 or pad:
                        loss = loss * (0.0 if pad else weight)
                    loss.backward()
                if not pad:
                    merged.add(stats, masked_mean(ent, pmask.to(dev)).item(), loss.item(), weight)
            stats = merged.result()
            stats["grad_norm"] = self._step(stats["loss"])
        self.timings["time_update"] += time.perf_counter() - t0
        return stats

    def _is_weight(self, old: torch.Tensor, part: RolloutBatch, pmask: torch.Tensor, record: bool):
        """The rollout/trainer importance weights of ``part`` (None when its engine sampled with
        the trained weights themselves), its mismatch stats recorded once per iteration."""
        if part.sampler_logp is None:
            return None
        c, dev = self.cfg.loss, self.info.device
        weight, stats = rollout_is_weights(old, part.sampler_logp.to(dev), pmask.to(dev), c.rollout_is,
                                           c.rollout_is_cap)
        if record:
            add_mismatch(self.mismatch, stats)
        return weight

    def _step(self, loss: float) -> float:
        """Clip and apply the update, or skip it (and count) when anything is non-finite."""
        limit = self.cfg.optim.max_grad_norm if self.cfg.optim.max_grad_norm > 0 else float("inf")
        norm = self.policy.clip_grad_norm(limit)
        bad = dist.all_reduce_max(float(not (math.isfinite(norm) and math.isfinite(loss))))
        if bad:
            self.opt.zero_grad(set_to_none=True)
            self.state["skipped_updates"] += 1
            self.state["nonfinite_in_a_row"] += 1
            if self.state["nonfinite_in_a_row"] >= MAX_NONFINITE_IN_A_ROW:
                raise NonFiniteError(f"[{self.cfg.runtime.stage}] {MAX_NONFINITE_IN_A_ROW} non-finite updates in a row "
                                     f"(non-finite loss or gradient norm; last on this rank: loss={loss}, "
                                     f"grad_norm={norm}); all were skipped, so the weights and the last good "
                                     "checkpoint are intact. Lower lr or check the rewards' scale.")
            return float("nan")
        self.state["nonfinite_in_a_row"] = 0
        self.opt.step()
        return norm

    # ---------------------------------------------------------------- metrics and evaluation
    def iteration_metrics(self, it: int, batch: RolloutBatch, roll: dict, upd: dict, seconds: float) -> dict:
        """The iteration's metrics over all ranks (one collective; see ``iteration_metrics``)."""
        sums = dist.all_reduce_named(local_sums(batch, roll, upd, self.reward_names), self.info.device)
        m = iteration_metrics(it, sums, seconds=seconds, world_size=self.info.world_size, lr=upd["lr"],
                              grad_norm=upd["grad_norm"], skipped_updates=self.state["skipped_updates"],
                              timings=self.timings, dynamic=roll if self.cfg.sampling.dynamic_sampling else None)
        if batch.sampler_logp is not None:  # the same engine on every rank: all ranks reduce, or none
            acc, dev = getattr(self, "mismatch", None) or new_mismatch(), self.info.device
            m.update(mismatch_metrics(dist.all_reduce_named({k: acc[k] for k in MISMATCH_SUMS}, dev),
                                      {k: dist.all_reduce_max(acc[k], dev) for k in MISMATCH_MAXES}))
        return m

    def evaluate(self) -> float:
        """Greedy accuracy on the validation subset, sharded across ranks, graded by the task's
        grader (looping answers stop early, as in the final evaluation)."""
        rows = self.eval_rows[self.info.rank::self.info.world_size]
        with self.policy.forward_only():
            res = greedy_results(self.policy.model, self.policy.tok, rows,
                                 max_new_tokens=self.cfg.eval_max_new_tokens(),
                                 max_prompt_tokens=self.cfg.sampling.max_prompt_tokens,
                                 system_prompt=self.cfg.system_prompt, engine=self.engine,
                                 grade=tasks.task(self.cfg.task).grade)
        right, total = dist.all_reduce_sum([sum(r["correct"] for r in res), len(res)], self.info.device)
        return right / max(total, 1)

    # ---------------------------------------------------------------- the stage
    def run(self) -> dict:
        """``_run``, then the rollout engine is closed (a server engine stops), however it ends."""
        try:
            return self._run()
        finally:
            self.engine.close()

    def _run(self) -> dict:
        """The GRPO loop: resume, then per iteration reseed, roll out, update, measure, gate,
        record and checkpoint; then the final model and the summary."""
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        start = self.resume()
        if self.info.is_main:
            example = render_prompts(self.policy.tok, [self.stream.take(0, 1)[0]["prompt"]], c.system_prompt)[0]
            self.recorder.log_objective(objective_card(c, self.info.world_size, example))
        # a checkpoint written when the gate fired ends the stage: resuming from it (a crash while
        # saving the final model) must not train on past the gate
        promoted = self.gate.fired
        it, last = start, start if promoted else c.iterations
        for it in range(start + 1, last + 1):
            self.timings = dict.fromkeys(TIMED_PHASES, 0.0)
            seed = iteration_seed(c.seed, it, self.info.rank)
            torch.manual_seed(seed)
            random.seed(seed)  # reward functions that draw from ``random`` resume exactly too, on every rank
            t0 = time.perf_counter()
            batch, roll = self.rollout()
            upd = self.update(batch)
            m = self.iteration_metrics(it, batch, roll, upd, time.perf_counter() - t0)
            if self.pool is not None:  # after this iteration's groups; replayed: prompts of all ranks
                m.update(self.pool.counts(it), pool_replayed=float(roll.get("replayed_prompts", 0)))
            every = c.validation.every
            if self.eval_rows is not None and ((every and it % every == 0) or it == c.iterations):
                m["eval_accuracy"] = self.evaluate()
                m["eval_n"] = len(self.eval_rows)  # validation items it is over (validation.size, or all there are)
            promoted = self.gate.observe(m)
            self.state["iteration"] = it
            self._remember(m)
            self.recorder.record(m, batch, self.state["history"])
            if it % c.checkpoint.every == 0 or it == c.iterations or promoted:
                self.save_checkpoint(it)
            if promoted:
                dist.print0(f"[{c.runtime.stage}] promotion gate: {c.gate.metric} >= {c.gate.threshold} "
                            f"({c.gate.patience}x) at iteration {it}; moving on")
                break
        return self.finish(it, promoted, resumed_from=start)

    def _remember(self, m: dict) -> None:
        """The checkpointed history the divergence alarm reads: reward and accuracy, last 200."""
        point = {k: m[k] for k in ("iteration", "reward", "eval_accuracy") if k in m}
        self.state["history"] = (self.state["history"] + [point])[-200:]

    def finish(self, it: int, promoted: bool, resumed_from: int = 0) -> dict:
        """The final model (rank 0, to storage) and the stage summary (summary.json)."""
        summary = {"stage": self.cfg.runtime.stage, "iterations_run": it, "promoted_by_gate": promoted,
                   "resumed_from_iteration": resumed_from, "skipped_updates": self.state["skipped_updates"]}
        gathered = self.policy.full_state_dict()  # every rank takes part
        if self.info.is_main:
            summary["model_uri"] = self.checkpoints.publish_final(self.policy.final_model(), self.policy.tok, self.out,
                                                                  gathered)
            summary.update(self.recorder.close(it))
            storage.atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        dist.barrier()
        return summary

