"""Config validation every config shares: typed construction from a table (``from_dict``) and
the checks whose messages name the field and the fix."""
from __future__ import annotations

import dataclasses
import difflib
import math
import os
import types
import typing
from pathlib import Path
from urllib.parse import urlsplit

from grpo_core.io.paths import PROJECT_DIR


class ConfigError(ValueError):
    """A bad config value; the message names the field and the fix."""


def _check_type(where: str, name: str, value, hint):
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if any(_matches(value, a) for a in typing.get_args(hint)):
            return
    elif _matches(value, hint):
        return
    raise ConfigError(f"{where}.{name} = {value!r} has type {type(value).__name__}; expected {hint}")


def _matches(value, hint) -> bool:
    if hint is type(None):
        return value is None
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    origin = typing.get_origin(hint) or hint
    return isinstance(value, origin)


def from_dict(cls, data: dict, where: str):
    """Build dataclass ``cls`` from ``data``, naming any unknown or mistyped field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must be a table/dict, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls) if f.init]
    for key in data:
        if key not in names:
            hint = _unknown_field_hint(cls, hints, names, key, where)
            raise ConfigError(f"unknown field {where}.{key}.{hint} Allowed fields: {', '.join(names)}")
    kwargs = {}
    for name in names:
        if name not in data:
            continue
        value = data[name]
        if dataclasses.is_dataclass(hints[name]):  # a table; one with tables of its own parses them itself
            build = getattr(hints[name], "from_table", None)
            value = build(value, f"{where}.{name}") if build else from_dict(hints[name], value, f"{where}.{name}")
        else:
            _check_type(where, name, value, hints[name])
            if hints[name] is float or (typing.get_origin(hints[name]) in (typing.Union, types.UnionType)
                                        and float in typing.get_args(hints[name]) and isinstance(value, int)):
                value = float(value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:  # a required field is missing
        raise ConfigError(f"{where}: {exc}") from exc


def _unknown_field_hint(cls, hints: dict, names: list[str], key: str, where: str) -> str:
    """Where an unknown ``key`` of ``cls`` lives: the group that has a field of that name, else the
    closest field name."""
    for group in names:
        if dataclasses.is_dataclass(hints[group]) and key in {f.name for f in dataclasses.fields(hints[group])}:
            return f" It belongs in the {group!r} group: {where}.{group}.{key} (TOML: under [{where}.{group}])."
    close = difflib.get_close_matches(key, names, n=1)
    return f" Did you mean {close[0]!r}?" if close else ""


def require(cond: bool, where: str, msg: str):
    if not cond:
        raise ConfigError(f"{where}: {msg}")


def at_least(obj, where: str, low: int, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(v >= low, f"{where}.{name}", f"must be >= {low}, got {v}")


def positive(obj, where: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(math.isfinite(v) and v > 0, f"{where}.{name}", f"must be a finite number > 0, got {v}")


def non_negative(obj, where: str, *names: str) -> None:
    for name in names:
        v = getattr(obj, name)
        require(math.isfinite(v) and v >= 0, f"{where}.{name}", f"must be >= 0 and finite, got {v}")


def check_choice(value, allowed, where):
    require(value in allowed, where, f"{value!r} is not allowed; use one of {', '.join(map(str, allowed))}")


def check_arithmetic(ops: str, lo: int, hi: int, where: str):
    """The arithmetic task's operators and operand range (GRPO stages and the bootstrap SFT)."""
    require(lo <= hi, f"{where}.arithmetic_min", "must be <= arithmetic_max")
    require(bool(ops) and set(ops) <= set("+-*"), f"{where}.arithmetic_ops",
            f"{ops!r}: use a non-empty subset of '+-*'")


def check_no_credentials(uri: str) -> None:
    """An http(s) tracking URI must not carry a user or password: the URI is copied into every
    stage's config (stage.json, the flow's artifacts, pod specs) and would be stored with them.
    MLflow reads server credentials from the environment instead."""
    parts = urlsplit(uri)
    if parts.scheme in ("http", "https") and (parts.username or parts.password):
        raise ValueError(f"the MLflow tracking URI {parts.scheme}://***@{parts.hostname}... holds credentials, which "
                         "would be stored in every stage's config and the flow's artifacts; remove them from the "
                         "URI and set MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) "
                         "in the environment (a Kubernetes secret in compute.secrets for pods)")


VLLM_DEFAULT_VENV = PROJECT_DIR / ".vllm-venv"
VLLM_BUILD_COMMAND = "infra/vllm-env.sh"


def vllm_python(setting: str, where: str = "vllm") -> str:
    """The python of vLLM's environment that ``<where>.python`` names (a venv directory or its
    python; empty: the repo's ``.vllm-venv``). A missing one is a ConfigError naming the field and
    the command that builds it."""
    path = Path(setting).expanduser() if setting else VLLM_DEFAULT_VENV
    python = path / "bin" / "python" if path.is_dir() else path
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise ConfigError(f"{where}.python = {setting!r}: no vLLM environment at {python}. Build it with "
                          f"`{VLLM_BUILD_COMMAND} {'' if not setting else path}`".rstrip() + " (from the repo root), "
                          f"or point {where}.python at a venv (or its python) where `import vllm` works")
    return str(python)
