"""Run by tests/test_trainer.py, alone or under torchrun: one GRPO update on a fixed global batch.

Each rank takes its half of the same 8-completion batch (uneven completion lengths, so the two
halves hold different token counts) and calls the real ``Trainer.update``; rank 0 saves the
gradients. With loss_type 'dapo' the result must not depend on the split. prompts 'shared' gives
the G rows of a group one prompt (as rollouts do: the shared-prefix scoring path, under DDP through
``CompletionScorer``); 'mixed' gives every row its own (the full-forward path). scale is the
advantage scale, computed by ``Trainer.advantages`` on each rank's shard.
"""
import sys

import torch
from safetensors.torch import save_file

from grpo_core import dist
from grpo_core.config import GRPOConfig
from grpo_core.trainer import Trainer
from grpo_core.types import RolloutBatch

from grpo_core import scoring

model_dir, out_file, loss_type, prompts, scale = sys.argv[1:6]
shared_calls = []
_shared = scoring._shared_prefix_logits
scoring._shared_prefix_logits = lambda *a, **k: shared_calls.append(1) or _shared(*a, **k)
info = dist.init()
cfg = GRPOConfig(model=model_dir, output_dir=out_file + ".d", loss_type=loss_type, beta=0.04, scale=scale,
                 lr=1e-2, group_size=4, prompts_per_iter=2, max_grad_norm=0.0)
trainer = Trainer(cfg, info)
g = torch.Generator().manual_seed(0)
B, P, T = 8, 5, 7
lengths = torch.tensor([7, 1, 2, 6, 7, 7, 5, 7])
mask = torch.arange(T)[None] < lengths[:, None]
prompt_ids = torch.randint(10, 60, (B, P), generator=g)
if prompts == "shared":
    prompt_ids = prompt_ids[::4].repeat_interleave(4, 0)
batch = RolloutBatch(prompt_ids, torch.ones(B, P, dtype=torch.long),
                     torch.randint(10, 60, (B, T), generator=g), mask, torch.zeros(B, dtype=torch.bool),
                     4, [""] * B, [""] * B)
batch.rewards = torch.tensor([1., 0, 0, 1, 0.5, 0, 1, 1])
per = B // info.world_size
rows = torch.zeros(B // 4, dtype=torch.bool)
rows[info.rank * (per // 4):(info.rank + 1) * (per // 4)] = True
shard = batch.select_groups(rows)
shard.advantages = trainer.advantages(shard.rewards)  # scale="batch": the std over all ranks
trainer.timings = dict.fromkeys(("time_generate", "time_reward", "time_ref", "time_update"), 0.0)
trainer.update(shard)
if info.is_main:
    # gradients after DDP's all-reduce (Adam's first step amplifies float noise in near-zero
    # gradients to +-lr, so the gradient is the right thing to compare to float tolerance)
    grads = {n: p.grad.contiguous() for n, p in trainer.model.named_parameters() if p.grad is not None}
    save_file({**grads, "shared_prefix_calls": torch.tensor(float(len(shared_calls)))}, out_file)
dist.cleanup()
dist.end_worker_process()
