"""The GPU check's multi-process part (run under torchrun by ``benchmarks/gpu_check.py ddp``): an
all_reduce, one DDP Trainer.update against the one-process gradient, then FSDP2 in fp32 and bf16.
"""
from __future__ import annotations

import copy

import torch
from gpu_check_common import check, close_grads, cosine, fixed_batch, grads, tiny_dir, trainer_for

from grpo_core.policy import dist, sharding
from grpo_core.policy.policy import wrap_ddp
from grpo_core.policy.scoring import completion_logprobs
from grpo_core.rollout.batch import RolloutBatch


def ddp_part(tmp: str) -> dict:
    model_dir = tiny_dir(tmp)  # before the process group: transformers saves on rank 0 only once it exists
    info = dist.init()
    dev, world = info.device, info.world_size
    t = torch.tensor([float(info.rank + 1)], device=dev)
    torch.distributed.all_reduce(t)
    ok_reduce = t.item() == world * (world + 1) / 2
    full = fixed_batch(2 * world, 4)
    rows = torch.zeros(2 * world, dtype=torch.bool)
    rows[2 * info.rank: 2 * info.rank + 2] = True
    tr = trainer_for(model_dir, f"{tmp}/ddp{info.rank}", info, prompts_per_iter=2 * world)
    if not isinstance(tr.policy.trained, torch.nn.parallel.DistributedDataParallel):  # one GPU: still go through DDP
        tr.policy.trained = wrap_ddp(tr.policy.model, info)  # the trainer wraps only when world > 1
    tr.update(full.select_groups(rows))
    res = {"world_size": world, "backend": torch.distributed.get_backend(), "all_reduce_ok": ok_reduce}
    ddp_grads = grads(tr.policy.model)
    fsdp = {prec: fsdp2_grads(model_dir, tmp, info, full, rows, prec) for prec in ("fp32", "bf16")}
    dist.cleanup()  # the one-process reference below must not join collectives
    if info.is_main:
        print(f"== ddp: {world} rank(s), backend {res['backend']}", flush=True)
        check("all_reduce sum over ranks", ok_reduce)
        one = trainer_for(model_dir, f"{tmp}/one", dist.DistInfo(0, 1, 0, dev), prompts_per_iter=2 * world)
        one.update(copy.deepcopy(full))
        ok, worst = close_grads(ddp_grads, grads(one.policy.model))
        check("DDP update gradients == one-process update (dapo)", ok, f"(worst rel diff {worst:.1e})")
        res["worst_rel_grad_diff"] = worst
        reference = grads(one.policy.model) if world > 1 else direct_grads(model_dir, dev, full)
        ok, worst = close_grads(fsdp["fp32"], reference)
        check(f"FSDP2 fp32 gradients == one-process ({'trainer update' if world > 1 else '1-rank shard'})",
              ok, f"(worst rel diff {worst:.1e})")
        cos = cosine(fsdp["bf16"], reference)
        check("FSDP2 bf16 mixed-precision gradients ~ fp32 (cosine > 0.99)", 0.99 < cos, f"(cosine {cos:.5f})")
        res.update(fsdp2_worst_rel_grad_diff=worst, fsdp2_bf16_cosine=cos)
    return res


def fsdp2_grads(model_dir: str, tmp: str, info, full: RolloutBatch, rows, precision: str) -> dict:
    """Whole gradients (gathered from the shards) of one fsdp2 update on every rank's groups:
    the trainer's with >= 2 ranks; with one, the tiny model sharded over the 1-rank group
    directly, scoring all of ``full`` through FSDP's root (``direct_grads``' loss)."""
    if info.world_size > 1:
        tr = trainer_for(model_dir, f"{tmp}/fsdp-{precision}{info.rank}", info, prompts_per_iter=2 * info.world_size,
                         execution={"parallelism": "fsdp2", "precision": precision})
        tr.update(full.select_groups(rows))
        model = tr.policy.model
    else:
        from grpo_core.model.loading import load_policy

        model, _ = load_policy(model_dir)
        model.to(info.device)
        root = sharding.shard(model, precision)
        with torch.autocast(info.device.type, dtype=torch.bfloat16, enabled=precision == "bf16"):
            logp, _ = root(copy.deepcopy(full), 1.0)
        (logp * full.completion_mask.to(info.device)).sum().backward()
    return {n: sharding.full_value(p.grad).detach().float().cpu() for n, p in model.named_parameters()
            if p.grad is not None}


def direct_grads(model_dir: str, dev, full: RolloutBatch) -> dict:
    """The unsharded fp32 gradient of the loss ``fsdp2_grads`` uses on one GPU."""
    from grpo_core.model.loading import load_policy

    model, _ = load_policy(model_dir)
    model.to(dev)
    logp, _ = completion_logprobs(model, copy.deepcopy(full), 1.0)
    (logp * full.completion_mask.to(dev)).sum().backward()
    return grads(model)
