"""Run by tests/test_trainer.py, alone or under torchrun: one GRPO update on a fixed global batch.

Each rank takes its half of the same 8-completion batch (uneven completion lengths, so the two
halves hold different token counts) and calls the real ``Trainer.update``; rank 0 saves the
updated weights. With loss_type 'dapo' the result must not depend on the split.
"""
import sys

import torch
from safetensors.torch import save_file

from grpo_core import dist
from grpo_core.config import GRPOConfig
from grpo_core.trainer import Trainer
from grpo_core.types import RolloutBatch

model_dir, out_file, loss_type = sys.argv[1], sys.argv[2], sys.argv[3]
info = dist.init()
cfg = GRPOConfig(model=model_dir, output_dir=out_file + ".d", loss_type=loss_type, beta=0.04,
                 lr=1e-2, group_size=4, prompts_per_iter=2, max_grad_norm=0.0)
trainer = Trainer(cfg, info)
g = torch.Generator().manual_seed(0)
B, P, T = 8, 5, 7
lengths = torch.tensor([7, 1, 2, 6, 7, 7, 5, 7])
mask = torch.arange(T)[None] < lengths[:, None]
batch = RolloutBatch(torch.randint(10, 60, (B, P), generator=g), torch.ones(B, P, dtype=torch.long),
                     torch.randint(10, 60, (B, T), generator=g), mask, torch.zeros(B, dtype=torch.bool),
                     4, [""] * B, [""] * B)
batch.rewards = torch.tensor([1., 0, 0, 1, 0.5, 0, 1, 1])
from grpo_core.algorithm import group_advantages
batch.advantages = group_advantages(batch.rewards, 4)
per = B // info.world_size
rows = torch.zeros(B // 4, dtype=torch.bool)
rows[info.rank * (per // 4):(info.rank + 1) * (per // 4)] = True
trainer.timings = dict.fromkeys(("time_generate", "time_reward", "time_ref", "time_update"), 0.0)
trainer.update(batch.select_groups(rows))
if info.is_main:
    # gradients after DDP's all-reduce (Adam's first step amplifies float noise in near-zero
    # gradients to +-lr, so the gradient is the right thing to compare to float tolerance)
    save_file({n: p.grad.contiguous() for n, p in trainer.model.named_parameters()
               if p.grad is not None}, out_file)
dist.cleanup()
