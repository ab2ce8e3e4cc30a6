"""Builders shared by the trainer tests: the 6-iteration stage on the tiny model, a Trainer in
this process, and one GRPO update on a fixed batch run alone or under torchrun
(``tests/ddp_update_check.py``), returning its gradients.
"""
import json
import os
import subprocess
import sys

from safetensors.torch import load_file

from grpo_core.config.pipeline import deep_merge
from grpo_core.train.entry import load_config
from tests.helpers import REPO, SEVENS, stage_args


def trainer_stage(tiny, out, **kw):
    base = dict(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=6,
                optim=dict(lr=3e-3, mu=2), loss=dict(beta=0.04), prompts_per_iter=4,
                sampling=dict(group_size=4, max_new_tokens=12), checkpoint=dict(every=2))
    return stage_args(**deep_merge(base, kw))


def in_process_trainer(tiny, out, **kw):
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    return Trainer(load_config(None, [a.removeprefix("--set=") for a in trainer_stage(tiny, out, **kw)]), dist.init())


def ddp_update(tiny, out, nproc, loss_type, prompts="shared", scale="group", micro_batch_groups=0, groups=2,
               rank0_groups=0, last_rank_empty=False, **extra):
    script = str(REPO / "tests" / "ddp_update_check.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    cmd = ([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", script]
           if nproc > 1 else [sys.executable, script])
    args = [str(tiny), str(out), loss_type, prompts, scale, str(micro_batch_groups), str(groups), str(rank0_groups),
            "last-rank-empty" if last_rank_empty else "-", json.dumps(extra)]
    run = subprocess.run(cmd + args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{' '.join(cmd[2:4])} exited {run.returncode}:\n{run.stderr[-6000:]}"
    grads = load_file(str(out))
    return grads, grads.pop("shared_prefix_calls").item()
