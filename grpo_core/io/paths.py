"""Where the project lives: the directory that holds ``grpo_core/`` (a clone's root, or the
flow's folder through its ``grpo_core`` symlink's target). The local default's stores
(``.grpo/``: artifacts, models, the MLflow db) and the vLLM venv (``.vllm-venv``) are under it."""
from pathlib import Path

PROJECT_DIR = Path(__file__).resolve().parents[2]
