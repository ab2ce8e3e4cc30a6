"""Run one GRPO stage: ``python -m grpo_core.train --config STAGE.json [--set key=value ...]``.

Alone it runs as one process; under torchrun it runs DDP (gloo on CPU, nccl on GPU):

    python -m torch.distributed.run --standalone --nproc_per_node=2 -m grpo_core.train \\
        --config stage.json --set iterations=40 --set optim.lr=3e-4

``--set`` keys are dotted paths into the config's groups (``sampling.temperature``,
``runtime.model``); values are parsed as JSON when they parse (numbers, true/false, null,
lists), else kept as strings. The config is validated before any model is loaded.
"""
from __future__ import annotations

import argparse
import json
import os

from grpo_core.config.checks import ConfigError, from_dict
from grpo_core.config.pipeline import deep_merge
from grpo_core.config.stage import GRPOConfig


def parse_overrides(pairs: list[str]) -> dict:
    """``--set`` pairs as a nested dict: ``optim.lr=3e-4`` -> ``{"optim": {"lr": 3e-4}}``."""
    out: dict = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key or "" in key.split("."):
            raise ConfigError(f"--set {pair!r}: use key=value, e.g. --set optim.lr=3e-4")
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        *groups, name = key.split(".")
        table = out
        for g in groups:
            table = table.setdefault(g, {})
            if not isinstance(table, dict):
                raise ConfigError(f"--set {pair!r}: {g} is a value, not a group")
        table[name] = value
    return out


def load_config(path: str | None, overrides: list[str]) -> GRPOConfig:
    data = {}
    if path:
        try:
            with open(path) as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"--config {path}: cannot read it ({exc.strerror}); pass the stage "
                              "config JSON the pipeline wrote (stage.json)") from exc
        except json.JSONDecodeError as exc:
            raise ConfigError(f"--config {path}: not valid JSON at line {exc.lineno} column {exc.colno} "
                              f"({exc.msg}); fix the file or pass fields with --set key=value") from exc
        if not isinstance(data, dict):
            raise ConfigError(f"--config {path}: expected a JSON object of GRPOConfig fields, "
                              f"got {type(data).__name__}")
    return from_dict(GRPOConfig, deep_merge(data, parse_overrides(overrides)), "stage")


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="stage config JSON (GRPOConfig fields)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a field")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    threads = os.environ.get("OMP_NUM_THREADS")
    import torch

    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    if threads:
        torch.set_num_threads(int(threads))
    info = dist.init(cfg.execution.collective_timeout_s)
    try:
        summary = Trainer(cfg, info).run()
    except BaseException as exc:
        timed_out = dist.as_timeout_error(exc, cfg.execution.collective_timeout_s,
                                          f"stage '{cfg.runtime.stage}'.execution.collective_timeout_s")
        dist.cleanup(finished=False)
        if timed_out:
            raise timed_out from exc
        raise
    dist.cleanup()
    return summary
