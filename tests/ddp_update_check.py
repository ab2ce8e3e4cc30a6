"""Run by tests/trainer_helpers.py:ddp_update, alone or under torchrun: one GRPO update on a fixed global batch.

Each rank takes its half of the same batch (8 completions, or 4 x ``groups``) (uneven completion lengths, so the two
halves hold different token counts) and calls the real ``Trainer.update``; rank 0 saves the
gradients. With loss_type 'dapo' the result must not depend on the split. prompts 'shared' gives
the G rows of a group one prompt (as rollouts do: the shared-prefix scoring path, under DDP through
``CompletionScorer``); 'mixed' gives every row its own (the full-forward path). scale is the
advantage scale, computed by ``Trainer.advantages`` on each rank's shard. micro_batch_groups
(optional, default 0) splits each rank's shard into micro-batches (DDP ``no_sync`` until the last);
rank0_groups (optional) gives rank 0 that many groups and rank 1 the rest (dynamic sampling leaves
ranks with different numbers of groups); "last-rank-empty" (optional) takes the last rank's groups
out of the loss (``loss_rows`` False), as dynamic sampling does on a rank left with nothing informative.
A JSON object (optional, argument 10) adds GRPOConfig fields, groups as tables (e.g.
{"execution": {"parallelism": "fsdp2"}}: the update then runs through FSDP's sharded root).
"""
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stage import GRPOConfig
from grpo_core.policy import dist, scoring, sharding
from grpo_core.train.trainer import Trainer
from tests.helpers import fixed_rollout_batch

model_dir, out_file, loss_type, prompts, scale = sys.argv[1:6]
micro_batch_groups = int(sys.argv[6]) if len(sys.argv) > 6 else 0
groups = int(sys.argv[7]) if len(sys.argv) > 7 else 2
rank0_groups = int(sys.argv[8]) if len(sys.argv) > 8 and int(sys.argv[8]) > 0 else None  # None: an even split
last_rank_empty = len(sys.argv) > 9 and sys.argv[9] == "last-rank-empty"  # its groups out of the loss
extra = json.loads(sys.argv[10]) if len(sys.argv) > 10 else {}
shared_calls = []
_shared = scoring._shared_prefix_outputs
scoring._shared_prefix_outputs = lambda *a, **k: shared_calls.append(1) or _shared(*a, **k)
_packed = scoring._packed_logprobs  # the padding-free form of the same shared-prompt scoring
scoring._packed_logprobs = lambda *a, **k: shared_calls.append(1) or _packed(*a, **k)
info = dist.init()
fields = dict(runtime={"model": model_dir, "output_dir": out_file + ".d"},
              loss={"type": loss_type, "beta": 0.04, "scale": scale}, optim={"lr": 1e-2, "max_grad_norm": 0.0},
              sampling={"group_size": 4}, prompts_per_iter=groups * info.world_size,  # unused: the batch below
              # is fixed; the trainer only checks that prompts split across ranks
              execution={"micro_batch_groups": micro_batch_groups})
cfg = GRPOConfig(**deep_merge(fields, extra))
trainer = Trainer(cfg, info)
batch = fixed_rollout_batch(groups, shared_prompts=prompts == "shared")
B = len(batch)
per = groups // info.world_size
bounds = [0, rank0_groups, groups] if rank0_groups and info.world_size == 2 else \
    [r * per for r in range(info.world_size + 1)]
rows = torch.zeros(groups, dtype=torch.bool)
rows[bounds[info.rank]:bounds[info.rank + 1]] = True
shard = batch.select_groups(rows)
if last_rank_empty and info.rank == info.world_size - 1:  # as dynamic sampling leaves a rank with nothing informative
    shard.loss_rows = torch.zeros(len(shard), dtype=torch.bool)
shard.advantages = trainer.advantages(shard.rewards, shard.loss_rows)  # scale="batch": the std over all ranks
trainer.update(shard)
# gradients after DDP's all-reduce, or FSDP's reduce-scatter gathered whole (a collective: every
# rank); Adam's first step amplifies float noise in near-zero gradients to +-lr, so the gradient
# is the right thing to compare to float tolerance
grads = {n: sharding.full_value(p.grad).contiguous() for n, p in trainer.policy.model.named_parameters()
         if p.grad is not None}
if info.is_main:  # this rank's parameter, gradient and AdamW-state bytes (what fsdp2 divides)
    Path(out_file + ".bytes.json").write_text(json.dumps(sharding.training_bytes(trainer.policy.model, trainer.opt)))
    save_file({**grads, "shared_prefix_calls": torch.tensor(float(len(shared_calls)))}, out_file)
dist.cleanup()
dist.end_worker_process()
