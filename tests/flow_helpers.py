"""Builders shared by the flow tests: the tiny pipeline config, an isolated Metaflow environment
(METAFLOW_HOME, datastore, MLflow sqlite db and storage root under one directory) and a flow
run through the Runner API.
"""
import os
import tomllib
from dataclasses import dataclass

from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stages import GRPO_STAGES
from tests.conftest import S3_ENV
from tests.helpers import GSM8K_DIR, REPO, require_gsm8k

FLOW = str(REPO / "flows" / "grpo_flow.py")
K8S_CFG = str(REPO / "flows" / "configs" / "kubernetes.toml")
TRAINING_STEPS = {s.step for s in GRPO_STAGES}  # the stage table names the flow's training steps
TINY = {
    "name": "tiny",
    "sft": {"steps": 30},
    "curriculum": {"iterations": 2, "prompts_per_iter": 4, "sampling": {"group_size": 4, "max_new_tokens": 12},
                   "checkpoint": {"every": 2}, "validation": {"every": 2, "size": 8}},
    "gsm8k": {"iterations": 4, "prompts_per_iter": 2, "sampling": {"group_size": 4, "max_new_tokens": 12},
              "checkpoint": {"every": 2}, "validation": {"size": 4}},
    "evaluate": {"gsm8k": {"size": 8}, "arithmetic": {"size": 16}, "max_new_tokens": 12},
}

os.environ.setdefault("USERNAME", "pytest")  # Runner resolves the Metaflow user in this process too


def tiny_config(root, **overrides) -> dict:
    """The tiny pipeline config for a flow run; a flow run reads GSM8K, so the test needs GSM8K_DIR."""
    require_gsm8k()
    with open(REPO / "flows" / "configs" / "tiny.toml", "rb") as f:
        base = tomllib.load(f)
    cfg = deep_merge(base, TINY)
    cfg.update(storage_root=str(root / "store"), tracking_uri=f"sqlite:///{root / 'mlflow.db'}")
    return deep_merge(cfg, overrides)


def mf_env(root, **extra) -> dict:
    for d in ("mfhome", "tmp", "work"):
        (root / d).mkdir(parents=True, exist_ok=True)
    env = {"METAFLOW_HOME": str(root / "mfhome"), "METAFLOW_DATASTORE_SYSROOT_LOCAL": str(root),
           "METAFLOW_DEFAULT_DATASTORE": "local", "METAFLOW_DEFAULT_METADATA": "local",
           "USERNAME": "pytest", "METAFLOW_TEMPDIR": str(root / "tmp"), "GSM8K_DIR": str(GSM8K_DIR),
           "GRPO_WORK_DIR": str(root / "work"), "PYTHONPATH": str(REPO)}
    return {**env, **extra}


@dataclass
class FlowResult:
    """What a Runner call left: read inside the Runner block, since closing the Runner deletes
    the files its ``stdout``/``stderr`` read from (a failing assert must still show them)."""
    status: str
    run: object
    stdout: str
    stderr: str


def run_flow(root, cfg: dict, resume_from: str | None = None, datastore: str = "local",
             **env_extra) -> FlowResult:
    from metaflow import Runner

    env = mf_env(root, **env_extra)
    opts = dict(show_output=False, env=env, cwd=str(root), datastore=datastore, file_read_timeout=900)
    config = {} if resume_from else {"config_value": [("cfg", cfg)]}  # resume reuses the origin's
    with Runner(FLOW, **config, **opts) as r:
        done = r.resume(origin_run_id=resume_from) if resume_from else r.run()
        return FlowResult(done.status, done.run, done.stdout, done.stderr)


def s3_creds():
    return {"aws_access_key_id": S3_ENV["AWS_ACCESS_KEY_ID"], "aws_secret_access_key": S3_ENV["AWS_SECRET_ACCESS_KEY"]}
