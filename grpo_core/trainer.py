"""The GRPO loop for one stage: rollouts -> rewards -> advantages -> clipped update + k3 KL.

Each iteration reseeds from (seed, iteration, rank) and draws its prompts from a deterministic
stream position, so a stage restarted from its latest checkpoint produces bitwise the same
weights as an uninterrupted run. Prompts are sharded across ranks by whole groups; metrics are
all-reduced; only rank 0 writes files and talks to MLflow. Metrics reach MLflow at checkpoint
commit points (and at the end): a crashed stage that resumes never logs a step twice.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import random
import time
import warnings
from pathlib import Path

import torch

from grpo_core import checkpoint, dist, storage
from grpo_core.algorithm import group_advantages, informative_mask, masked_mean, std_from_moments
from grpo_core.config import METRICS_FILE, ConfigError
from grpo_core.data import PromptStream, eval_rows, train_rows
from grpo_core.evaluate import greedy_results
from grpo_core.health import divergence_alarm
from grpo_core.losses import grpo_loss, micro_batch_weight
from grpo_core.models import (
    activation_checkpointing_paused,
    disable_dropout,
    enable_activation_checkpointing,
    load_policy,
    save_policy,
)
from grpo_core.objective import objective_card
from grpo_core.rewards import RewardSpec, combine_rewards, resolve_specs
from grpo_core.rollout import generate_rollouts, render_prompts
from grpo_core.scoring import completion_logprobs
from grpo_core.stats import window_change
from grpo_core.tracking import plot_curves, read_jsonl
from grpo_core.tracking_logger import open_tracker
from grpo_core.types import RolloutBatch
from grpo_core.update_parts import (
    MergedStats,
    compile_for_scoring,
    fused_adamw_ok,
    precision_context,
    scored_without_grad,
    wrap_ddp,
)

LOGGED_AT = "logged_at_ms"  # metrics.jsonl: when the row's points were logged (their MLflow timestamp)
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
            raise ConfigError(f"stage '{cfg.stage}'.prompts_per_iter: {cfg.prompts_per_iter} prompts cannot be split "
                              f"across {info.world_size} ranks; use a multiple of {info.world_size}")
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.metrics_path = self.out / METRICS_FILE  # one JSON line per iteration (rank 0)
        torch.manual_seed(cfg.seed)
        self.model, self.tok = load_policy(cfg.model, trust_remote_code=cfg.trust_remote_code)
        if cfg.disable_dropout:
            disable_dropout(self.model)
        self.model.to(info.device).train()
        if cfg.gradient_checkpointing:
            try:
                enable_activation_checkpointing(self.model)
            except ValueError as exc:
                raise ConfigError(f"stage '{cfg.stage}'.gradient_checkpointing: {exc}; set it to false") from exc
        self.ref = None
        if cfg.beta > 0:  # the reference is always the stage's starting policy, also on resume
            self.ref, _ = load_policy(cfg.model, trust_remote_code=cfg.trust_remote_code)
            self.ref.to(info.device).eval().requires_grad_(False)
        # what scores completions: the policy itself, or compiled (same parameters); the update
        # scores through self.ddp, DDP around a CompletionScorer on > 1 rank
        self.scorer, self.ref_scorer = self.model, self.ref
        if cfg.compile_scoring:
            self.scorer = compile_for_scoring(self.model)
            self.ref_scorer = compile_for_scoring(self.ref) if self.ref is not None else None
        self.ddp = self.scorer
        if info.world_size > 1:
            self.ddp = wrap_ddp(self.scorer, info)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay,
                                     fused=fused_adamw_ok(self.model))
        self.sched = self._schedule()
        self.rewards = resolve_specs([RewardSpec(**r) for r in cfg.rewards])
        self.stream = PromptStream(train_rows(cfg), cfg.seed)
        self.eval_rows = eval_rows(cfg, cfg.eval_size) if (cfg.eval_every or cfg.gate_metric) else None
        self.state = {"iteration": 0, "data_position": 0, "nonfinite_in_a_row": 0,
                      "skipped_updates": 0, "gate_hits": 0, "history": []}
        self.timings = dict.fromkeys(TIMED_PHASES, 0.0)  # seconds per phase of the current iteration
        self.spill_path = self.out / "pending_metrics.jsonl"  # tracking points the server did not take
        self.tracker = open_tracker(cfg.tracking_uri, cfg.tracking_run_id, info.rank, spill_path=str(self.spill_path))

    # ---------------------------------------------------------------- resume and checkpoints
    def resume(self) -> int:
        """Continue from the newest verified checkpoint (local, this run's or the origin's)."""
        locations = [str(self.ckpt_dir)] + [storage.join(u, "checkpoints") for u in self.cfg.resume_from]
        path = checkpoint.latest(locations, self.out / ".downloaded") if self.info.is_main else None
        path_str = [str(path) if path else ""]
        if dist.active():
            torch.distributed.broadcast_object_list(path_str, src=0)
        if not path_str[0]:
            return 0
        self.state = checkpoint.load(path_str[0], self.model, self.opt, self.sched)
        self.sched = self._schedule(done_iterations=self.state["iteration"])
        self._restore_metrics(Path(path_str[0]), self.state["iteration"])
        self._resend_metrics()
        self._republish(Path(path_str[0]), self.state["iteration"])
        dist.print0(f"[{self.cfg.stage}] resumed from {path_str[0]} at iteration {self.state['iteration']}")
        return self.state["iteration"]

    def _schedule(self, done_iterations: int = 0) -> torch.optim.lr_scheduler.LambdaLR:
        """Linear warm-up over ``warmup_iters`` iterations. Its position is the number of
        iterations done, so a resume sets it from the checkpoint's iteration rather than trusting
        the saved counter: checkpoints written before the schedule advanced once per iteration
        counted optimizer steps, which ran ahead of the iterations with mu > 1."""
        warm = max(self.cfg.warmup_iters, 0)
        return torch.optim.lr_scheduler.LambdaLR(
            self.opt, lambda it: min(1.0, (it + 1) / warm) if warm else 1.0, last_epoch=done_iterations - 1)

    def _republish(self, ckpt: Path, iteration: int) -> None:
        """Copy a checkpoint found elsewhere (the origin run of a flow ``resume``) to this run's
        own sync_uri. A resume of this run searches only this run and its direct origin: if this
        run failed before writing a checkpoint of its own, the work would otherwise restart at 0."""
        if not (self.info.is_main and self.cfg.sync_uri):
            return
        copy = storage.join(self.cfg.sync_uri, "checkpoints", checkpoint.name_for(iteration))
        if not checkpoint.stored_complete(copy):  # absent, or an earlier republish cut short
            storage.put_dir(ckpt, copy)

    def _restore_metrics(self, ckpt: Path, iteration: int) -> None:
        """metrics.jsonl as it was at the checkpoint: its copy in the checkpoint (a flow ``resume``
        runs in a fresh output_dir, and the summary, reward trend and curves read this file),
        else this dir's own file cut back to the checkpoint's iteration (checkpoints from before
        the copy existed)."""
        f, saved = self.metrics_path, ckpt / METRICS_FILE
        if not self.info.is_main or not (saved.exists() or f.exists()):
            return
        lines = (saved if saved.exists() else f).read_text().splitlines()
        keep = [ln for ln in lines if json.loads(ln)["iteration"] <= iteration]
        storage.atomic_write_text(f, "".join(ln + "\n" for ln in keep))

    def _resend_metrics(self) -> None:
        """Queue the restored history for MLflow again, each point with its first timestamp: the
        store keeps identical points once, and points an outage held back when the first attempt
        crashed (they lived only in its memory) arrive after all. Sent at the next commit."""
        if not (self.info.is_main and self.metrics_path.exists()):
            return
        for row in read_jsonl(str(self.metrics_path)):
            if LOGGED_AT in row:  # rows written before the timestamp was kept cannot be sent idempotently
                self.tracker.log({k: v for k, v in row.items() if k not in ("iteration", LOGGED_AT)},
                                 step=row["iteration"], timestamp_ms=row[LOGGED_AT])

    def save_checkpoint(self, iteration: int) -> None:
        if self.info.is_main:
            extra = {METRICS_FILE: self.metrics_path} if self.metrics_path.exists() else {}
            path = checkpoint.save(self.ckpt_dir, iteration, self.model, self.opt, self.sched, self.state, extra)
            if self.cfg.sync_uri:
                remote = storage.join(self.cfg.sync_uri, "checkpoints")
                storage.put_dir(path, storage.join(remote, path.name))
                try:  # housekeeping: a bucket that refuses deletes must not stop training
                    checkpoint.prune_stored(remote, self.cfg.keep_checkpoints, written=path.name)
                except Exception as exc:
                    warnings.warn(f"could not prune old checkpoints under {remote}: {exc}")
            checkpoint.prune(self.ckpt_dir, self.cfg.keep_checkpoints, written=path.name)
            self.tracker.flush()  # commit point: metrics up to here are now durable
        dist.barrier()

    # ---------------------------------------------------------------- one iteration
    def _shard(self, rows: list[dict]) -> list[dict]:
        per = len(rows) // self.info.world_size
        return rows[self.info.rank * per:(self.info.rank + 1) * per]

    def _sample(self, n_prompts: int) -> RolloutBatch:
        c = self.cfg
        rows = self._shard(self.stream.take(self.state["data_position"], n_prompts))
        self.state["data_position"] += n_prompts
        with self._forward_only():
            batch = generate_rollouts(self.model, self.tok, rows, c.group_size, temperature=c.temperature,
                                      top_p=c.top_p, top_k=c.top_k, max_new_tokens=c.max_new_tokens,
                                      max_prompt_tokens=c.max_prompt_tokens, sampler=c.sampler,
                                      system_prompt=c.system_prompt)
        t0 = time.perf_counter()
        cols = {k: v for k, v in batch.columns.items() if k not in ("id", "think")}
        total, parts = combine_rewards(self.rewards, batch.prompts, batch.completions, cols,
                                       timeout_s=c.reward_timeout_s)
        batch.rewards = torch.tensor(total, dtype=torch.float32)
        self.reward_names = list(parts)  # the same functions, in the same order, every call
        batch.reward_parts = torch.tensor([parts[k] for k in self.reward_names],
                                          dtype=torch.float64).reshape(len(parts), len(batch)).T
        self.timings["time_reward"] += time.perf_counter() - t0
        return batch

    def rollout(self) -> tuple[RolloutBatch, dict]:
        """Sample, score, and (with dynamic sampling) refill until enough groups are informative."""
        c, G = self.cfg, self.cfg.group_size
        t0 = time.perf_counter()
        batch = self._sample(c.prompts_per_iter)
        drawn, informative_first = len(batch) // G, informative_mask(batch.rewards, G)
        stats = {"informative_groups": informative_first.float().sum().item(), "drawn_groups": drawn}
        if c.dynamic_sampling:
            kept, rounds = [batch.select_groups(informative_first)], 0
            need = lambda: dist.all_reduce_max(float(sum(b.num_groups for b in kept) < drawn))  # noqa: E731
            while rounds < c.max_resample_rounds and need() > 0:
                extra = self._sample(c.prompts_per_iter)
                kept.append(extra.select_groups(informative_mask(extra.rewards, G)))
                rounds += 1
            n_groups = min(sum(b.num_groups for b in kept), drawn)
            if n_groups:
                pool = RolloutBatch.concat([b for b in kept if len(b)], self.tok.pad_token_id)
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
        if c.scale == "batch" and dist.active():
            r = rewards.double() if loss_rows is None else rewards.double()[loss_rows]
            batch_std = std_from_moments(*dist.all_reduce_sum(
                [r.sum().item(), (r * r).sum().item(), r.numel()], self.info.device))
        return group_advantages(rewards, c.group_size, scale=c.scale, eps=c.adv_eps, batch_std=batch_std)

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
        if c.mask_truncated:
            mask &= ~batch.truncated.unsqueeze(1)
        rows = batch.loss_rows if batch.loss_rows is not None else torch.ones(len(batch), dtype=torch.bool)
        mask &= rows.unsqueeze(1)
        # one collective: the loss normalisers over all ranks, so no rank's share depends on the split
        global_tokens, global_rows = dist.all_reduce_sum([float(mask.sum()), float(rows.sum())], dev)
        if global_tokens == 0:  # nothing to learn anywhere (e.g. every completion masked): no step
            return {**MergedStats().result(), "grad_norm": 0.0}
        parts = batch.split_groups(c.micro_batch_groups)
        masks = [mask] if len(parts) == 1 else list(mask.split([len(p) for p in parts]))
        t0 = time.perf_counter()
        for part in parts:
            with self._forward_only():
                if self.ref is not None:
                    part.ref_logp = scored_without_grad(self.ref_scorer, part, c.temperature)
                if c.mu > 1:
                    part.old_logp = scored_without_grad(self.scorer, part, c.temperature)
        self.timings["time_ref"] += time.perf_counter() - t0
        for _ in range(c.mu):
            self.opt.zero_grad(set_to_none=True)
            merged = MergedStats()
            for k, (part, pmask) in enumerate(zip(parts, masks)):
                accumulate = k < len(parts) - 1 and isinstance(self.ddp, torch.nn.parallel.DistributedDataParallel)
                with self.ddp.no_sync() if accumulate else contextlib.nullcontext():
                    with self._precision():  # the forward only: backward follows autocast's forward dtypes
                        logp, ent = completion_logprobs(self.ddp, part, c.temperature, with_entropy=True)
                    old = part.old_logp if part.old_logp is not None else logp.detach()
                    loss, stats = grpo_loss(
                        logp, old.to(dev), None if part.ref_logp is None else part.ref_logp.to(dev),
                        part.advantages.to(dev), pmask.to(dev), clip_low=c.clip_low, clip_high=c.clip_high,
                        beta=c.beta, loss_type=c.loss_type, max_completion_length=c.max_new_tokens,
                        global_token_count=global_tokens, global_sequence_count=global_rows,
                        world_size=self.info.world_size)
                    weight = 1.0 if len(parts) == 1 else micro_batch_weight(
                        c.loss_type, len(part), len(batch), float(pmask.sum()), float(mask.sum()))
                    if weight != 1.0:
                        loss = loss * weight
                    loss.backward()
                merged.add(stats, masked_mean(ent, pmask.to(dev)).item(), loss.item(), weight)
            stats = merged.result()
            stats["grad_norm"] = self._step(stats["loss"])
        self.timings["time_update"] += time.perf_counter() - t0
        return stats

    def _precision(self):
        return precision_context(self.cfg.precision, self.info.device)

    @contextlib.contextmanager
    def _forward_only(self):
        """Forwards with no backward (rollouts, reference/old scoring, evaluation): the stage's
        precision, activation checkpointing paused (if on: pausing scans every module)."""
        paused = (activation_checkpointing_paused(self.model) if self.cfg.gradient_checkpointing
                  else contextlib.nullcontext())
        with self._precision(), paused:
            yield

    def _step(self, loss: float) -> float:
        """Clip and apply the update, or skip it (and count) when anything is non-finite."""
        limit = self.cfg.max_grad_norm if self.cfg.max_grad_norm > 0 else float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit).item()
        bad = dist.all_reduce_max(float(not (math.isfinite(norm) and math.isfinite(loss))))
        if bad:
            self.opt.zero_grad(set_to_none=True)
            self.state["skipped_updates"] += 1
            self.state["nonfinite_in_a_row"] += 1
            if self.state["nonfinite_in_a_row"] >= MAX_NONFINITE_IN_A_ROW:
                raise NonFiniteError(f"[{self.cfg.stage}] {MAX_NONFINITE_IN_A_ROW} non-finite updates in a row "
                                     f"(non-finite loss or gradient norm; last on this rank: loss={loss}, "
                                     f"grad_norm={norm}); all were skipped, so the weights and the last good "
                                     "checkpoint are intact. Lower lr or check the rewards' scale.")
            return float("nan")
        self.state["nonfinite_in_a_row"] = 0
        self.opt.step()
        return norm

    # ---------------------------------------------------------------- metrics and evaluation
    def _metrics(self, it: int, batch: RolloutBatch, roll: dict, upd: dict, seconds: float) -> dict:
        lens = batch.completion_mask.sum(-1).float()
        informative = informative_mask(batch.rewards, batch.group_size).float()
        local = [batch.rewards.sum().item(), (batch.rewards ** 2).sum().item(), len(batch),
                 informative.sum().item(), informative.numel(), lens.sum().item(),
                 batch.truncated.float().sum().item(), roll["informative_groups"], roll["drawn_groups"]]
        s = dist.all_reduce_sum(local, self.info.device)
        n = max(s[2], 1)
        mean = s[0] / n
        m = {"iteration": it, "reward": mean, "reward_std": math.sqrt(max(s[1] / n - mean ** 2, 0.0)),
             "informative_frac": s[7] / max(s[8], 1), "completion_len": s[5] / n,
             "truncated_frac": s[6] / n, "tokens_per_s": s[5] / max(seconds, 1e-9),
             "lr": upd["lr"], "skipped_updates": self.state["skipped_updates"]}
        if self.cfg.dynamic_sampling:
            m.update(informative_frac_kept=s[3] / max(s[4], 1), dynamic_rounds=roll["dynamic_rounds"],
                     dynamic_drawn=roll["dynamic_drawn"])
        # token means over all ranks' tokens (ranks may hold different numbers of them); the loss
        # as DDP averages it
        means, tokens = ("kl", "clip_frac", "clip_frac_low", "clip_frac_high", "ratio_mean", "entropy"), \
            upd["num_tokens"]
        # and each reward function's mean over the rows it applies to (None from it: not counted);
        # one collective for all of it
        parts = batch.reward_parts
        applies = ~parts.isnan()
        K = parts.shape[1]
        *sums, all_tokens, loss = dist.all_reduce_sum(
            [upd[k] * tokens for k in means] + parts.nan_to_num(0.0).sum(0).tolist() + applies.sum(0).tolist()
            + [tokens, upd["loss"]], self.info.device)
        m.update({k: v / max(all_tokens, 1.0) for k, v in zip(means, sums)}, loss=loss / self.info.world_size)
        m["grad_norm"] = upd["grad_norm"]
        m.update({k: round(v, 4) for k, v in self.timings.items()})
        part_sums, part_rows = sums[len(means):len(means) + K], sums[len(means) + K:]
        for name, total, rows in zip(self.reward_names, part_sums, part_rows):
            if rows:  # a function that applied to no row this iteration has no mean
                m[f"reward/{name.split(':')[-1]}"] = total / rows
        return m

    def evaluate(self) -> float:
        """Greedy accuracy on the validation subset, sharded across ranks."""
        rows = self.eval_rows[self.info.rank::self.info.world_size]
        with self._forward_only():
            res = greedy_results(self.model, self.tok, rows, max_new_tokens=self.cfg.eval_max_new_tokens
                                 or self.cfg.max_new_tokens, max_prompt_tokens=self.cfg.max_prompt_tokens,
                                 system_prompt=self.cfg.system_prompt)
        right, total = dist.all_reduce_sum([sum(r["correct"] for r in res), len(res)], self.info.device)
        return right / max(total, 1)

    def _gate(self, m: dict) -> bool:
        c = self.cfg
        if c.gate_metric is None or c.gate_metric not in m:
            return False
        self.state["gate_hits"] = self.state["gate_hits"] + 1 if m[c.gate_metric] >= c.gate_threshold else 0
        return self.state["gate_hits"] >= c.gate_patience

    def _record(self, m: dict, batch: RolloutBatch) -> None:
        point = {k: m[k] for k in ("iteration", "reward", "eval_accuracy") if k in m}
        self.state["history"] = (self.state["history"] + [point])[-200:]
        if not self.info.is_main:
            return
        logged_at = int(time.time() * 1000)  # kept, so a resumed stage can resend the point as it was
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps({**m, LOGGED_AT: logged_at}) + "\n")
        self.tracker.log({k: v for k, v in m.items() if k != "iteration"}, step=m["iteration"], timestamp_ms=logged_at)
        # the alarm reads evaluation points only, so it can change (and is reported) only at one
        alarm = divergence_alarm(self.state["history"]) if "eval_accuracy" in m else None
        if alarm:
            print(f"WARNING [{self.cfg.stage}] {alarm}", flush=True)
            self.tracker.log({"alarm/reward_task_divergence": 1.0}, step=m["iteration"])
            self.tracker.set_tags({"grpo.alarm": alarm})
        if m["iteration"] % self.cfg.sample_every == 0 or m["iteration"] == 1:
            it, samples = m["iteration"], [{"prompt": p, "completion": t, "reward": r} for p, t, r in
                                           zip(batch.prompts[:16], batch.completions[:16], batch.rewards.tolist()[:16])]
            self.tracker.log_dict({"iteration": it, "samples": samples}, f"samples/iter_{it:06d}.json")
            self.tracker.log_table({"iteration": [it] * len(samples), **{k: [s[k] for s in samples] for k in
                                    ("prompt", "completion", "reward")}}, f"samples/iter_{it:06d}_table.json")
            # the live training card reads it (pipeline.read_samples), MLflow or not
            storage.atomic_write_text(self.out / "samples_latest.json",
                                      json.dumps({"iteration": it, "samples": samples}))
        print(f"[{self.cfg.stage}] it {m['iteration']:4d} reward {m['reward']:.3f} "
              f"informative {m['informative_frac']:.2f} kl {m['kl']:.4f} len {m['completion_len']:.1f}"
              + (f" eval_acc {m['eval_accuracy']:.3f}" if "eval_accuracy" in m else ""), flush=True)

    # ---------------------------------------------------------------- the stage
    def run(self) -> dict:
        c = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        start = self.resume()
        if self.info.is_main:
            example = self.stream.take(0, 1)[0]["prompt"]
            card = objective_card(c, self.info.world_size, render_prompts(self.tok, [example], c.system_prompt)[0])
            storage.atomic_write_text(self.out / "objective.json", json.dumps(card, indent=1))
            # only those the run lacks: a rerun of the step (even one that restarts at 0) reuses the
            # run, whose output_dir and other runtime params MLflow refuses to change
            self.tracker.log_params({**c.to_dict(), **{f"objective.{k}": v for k, v in card.items()}},
                                    if_absent=True)
            self.tracker.log_artifact(str(self.out / "objective.json"))
        # a checkpoint written when the gate fired ends the stage: resuming from it (a crash while
        # saving the final model) must not train on past the gate
        promoted = c.gate_metric is not None and self.state["gate_hits"] >= c.gate_patience
        it, last = start, start if promoted else c.iterations
        for it in range(start + 1, last + 1):
            self.timings = dict.fromkeys(TIMED_PHASES, 0.0)
            seed = iteration_seed(c.seed, it, self.info.rank)
            torch.manual_seed(seed)
            random.seed(seed)  # reward functions that draw from ``random`` resume exactly too, on every rank
            t0 = time.perf_counter()
            batch, roll = self.rollout()
            upd = self.update(batch)
            m = self._metrics(it, batch, roll, upd, time.perf_counter() - t0)
            if self.eval_rows is not None and ((c.eval_every and it % c.eval_every == 0) or it == c.iterations):
                m["eval_accuracy"] = self.evaluate()
                m["eval_n"] = len(self.eval_rows)  # validation items it is over (eval_size, or all there are)
            promoted = self._gate(m)
            self.state["iteration"] = it
            self._record(m, batch)
            if it % c.save_every == 0 or it == c.iterations or promoted:
                self.save_checkpoint(it)
            _maybe_fail(c, it)
            if promoted:
                dist.print0(f"[{c.stage}] promotion gate: {c.gate_metric} >= {c.gate_threshold} "
                            f"({c.gate_patience}x) at iteration {it}; moving on")
                break
        return self.finish(it, promoted, resumed_from=start)

    def finish(self, it: int, promoted: bool, resumed_from: int = 0) -> dict:
        summary = {"stage": self.cfg.stage, "iterations_run": it, "promoted_by_gate": promoted,
                   "resumed_from_iteration": resumed_from,
                   "skipped_updates": self.state["skipped_updates"]}
        if self.info.is_main:
            final = save_policy(self.model, self.tok, self.out / "final")
            if self.cfg.sync_uri:
                summary["model_uri"] = storage.put_dir(final, storage.join(self.cfg.sync_uri, "final"))
            else:
                summary["model_uri"] = str(final)
            rows = read_jsonl(str(self.metrics_path)) if self.metrics_path.exists() else []
            metrics_only = lambda row: {k: v for k, v in row.items() if k != LOGGED_AT}  # noqa: E731
            summary["last"] = metrics_only(rows[-1]) if rows else {}
            summary["first"] = metrics_only(rows[0]) if rows else {}
            if rows:
                trend = summary["reward_trend"] = window_change([r["reward"] for r in rows])
                self.tracker.log({f"reward_trend/{k}": v for k, v in trend.items() if math.isfinite(v)}, it)
                # training curves as a PNG, for people who would rather look than read
                self.tracker.log_artifact(plot_curves(str(self.metrics_path), str(self.out / "curves.png")))
            self.tracker.flush()
            summary["tracking_delayed_points"] = getattr(self.tracker, "delayed_points", 0)
            self.tracker.close()
            if self.spill_path.exists() and self.cfg.sync_uri:  # kept beside the checkpoints, for replay
                summary["tracking_pending_uri"] = storage.write_text(
                    storage.join(self.cfg.sync_uri, self.spill_path.name), self.spill_path.read_text())
                summary["tracking_run_id"] = self.cfg.tracking_run_id
            storage.atomic_write_text(self.out / "summary.json", json.dumps(summary, indent=1))
        dist.barrier()
        return summary


def _maybe_fail(cfg, iteration: int) -> None:
    """Fault injection: GRPO_FAIL_AT='<stage>:<iteration>' or cfg.fail_at_iteration crashes here."""
    env = os.environ.get("GRPO_FAIL_AT", "")
    stage, _, at = env.partition(":")
    hit = cfg.fail_at_iteration == iteration or (stage == cfg.stage and at.isdigit() and int(at) == iteration)
    if hit and not os.path.exists(os.path.join(cfg.output_dir, f".failed-once-{iteration}")):
        if os.environ.get("GRPO_FAIL_ONCE"):
            Path(cfg.output_dir, f".failed-once-{iteration}").touch()
        raise RuntimeError(f"[{cfg.stage}] injected failure at iteration {iteration} (GRPO_FAIL_AT)")
