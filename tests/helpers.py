"""Small builders shared by tests: a tiny saved model, stage configs, safetensors comparison."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parents[1]
GSM8K_DIR = Path(__import__("os").environ.get("GSM8K_DIR", REPO.parent / "shared" / "data" / "gsm8k")).resolve()


def tiny_model_dir(path: Path, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    from grpo_core.models import build_tiny, save_policy

    if not (path / "config.json").exists():
        model, tok = build_tiny("llama", hidden, layers, 4, seed=seed)
        save_policy(model, tok, path)
    return path


def stage_args(**fields) -> list[str]:
    return [f"--set={k}={json.dumps(v)}" for k, v in fields.items()]


def same_weights(a: Path, b: Path) -> bool:
    wa, wb = load_file(str(a / "model.safetensors")), load_file(str(b / "model.safetensors"))
    return wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
