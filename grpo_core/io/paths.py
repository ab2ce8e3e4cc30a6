"""Where the project lives: the directory that holds ``grpo_core/`` (a clone's root, or the
flow's folder through its ``grpo_core`` symlink's target). The local default's stores
(``.grpo/``: artifacts, models, the MLflow db) and the vLLM venv (``.vllm-venv``) are under it."""
import os
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]


def subprocess_env(threads: int) -> dict:
    """This process's environment for a child that runs ``python -m grpo_core...`` (torchrun
    ranks, evaluation workers): ``threads`` OpenMP threads, and ``PROJECT_DIR`` first on its
    path, so the child imports the same grpo_core as this process."""
    return {**os.environ, "OMP_NUM_THREADS": str(threads),
            "PYTHONPATH": os.pathsep.join(filter(None, [str(PROJECT_DIR), os.environ.get("PYTHONPATH")]))}
