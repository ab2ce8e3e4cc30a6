"""A newcomer's project: a copy of this checkout where README's commands are typed as written.

The copy is the repository's files (``git ls-files``: tracked plus untracked, not ignored) in a
temporary directory, so the local default's stores (``.grpo/``, ``.metaflow/``) land in the copy
and ``$PWD`` in a command means the copy, as it means the clone for a user. Two things differ
from a fresh clone, both to keep CI short: the copy's ``flows/configs/tiny.toml`` is shrunk to
a few iterations per stage (``SHRINK``), and it registers under the local default's model name,
so README's registry commands (which name the local default's model) find what the tiny run
registered.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

from tests.helpers import GSM8K_DIR, REPO

BIN = Path(sys.executable).parent
LOCAL_CFG = "flows/configs/local.toml"
TINY_CFG = "flows/configs/tiny.toml"
# the shell lines README's commands start with (a chain's `&&` segments count as lines)
COMMAND_START = re.compile(r"(?:^|&&\s*|\s)(python flows/grpo_flow\.py\b|python -m grpo_core\b|mlflow ui\b)")
SHRINK = {
    "sft": {"steps": 30},
    "curriculum": {"iterations": 2, "prompts_per_iter": 4, "sampling": {"group_size": 4, "max_new_tokens": 12},
                   "checkpoint": {"every": 2}, "validation": {"every": 2, "size": 8}},
    "gsm8k": {"iterations": 2, "prompts_per_iter": 2, "sampling": {"group_size": 4, "max_new_tokens": 12},
              "checkpoint": {"every": 2}, "validation": {"size": 4}},
    "evaluate": {"gsm8k": {"size": 8, "bounded_size": 4}, "arithmetic": {"size": 16}, "sampled_size": 4,
                 "max_new_tokens": 12},
}


@dataclass(frozen=True)
class Command:
    """One command README shows: the text as written and where it stands."""
    text: str
    line: int

    @property
    def words(self) -> list[str]:
        return self.text.split()


def readme_commands(readme: str) -> list[Command]:
    """Every command in README's fenced code blocks that starts with ``python flows/grpo_flow.py``,
    ``python -m grpo_core`` or ``mlflow ui`` (also as a segment of an ``&&`` chain), without its
    trailing ``# comment``, in README's order."""
    found, fenced = [], False
    for n, line in enumerate(readme.splitlines(), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            continue
        for segment in line.split("&&"):
            m = COMMAND_START.search(segment)
            if m:
                text = segment[m.start(1):].split(" #")[0].strip()
                found.append(Command(text, n))
    return found


def toml_text(table: dict, path: tuple[str, ...] = ()) -> str:
    """``table`` as TOML (nested dicts of strings, numbers, booleans and lists), for a config file."""
    import json

    def value(v) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (list, tuple)):
            return "[" + ", ".join(value(x) for x in v) + "]"
        if isinstance(v, dict):
            return "{" + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + "}"
        return json.dumps(v)

    scalars = "".join(f"{k} = {value(v)}\n" for k, v in table.items() if not isinstance(v, dict))
    text = (f"\n[{'.'.join(path)}]\n" if path else "") + scalars
    return text + "".join(toml_text(v, (*path, k)) for k, v in table.items() if isinstance(v, dict))


def _tiny_config(project: Path) -> dict:
    from grpo_core.config.pipeline import deep_merge

    with open(project / TINY_CFG, "rb") as f:
        tiny = tomllib.load(f)
    with open(project / LOCAL_CFG, "rb") as f:
        local = tomllib.load(f)
    cfg = deep_merge(tiny, SHRINK)
    cfg["register"] = {**cfg.get("register", {}), "model_name": local["register"]["model_name"]}
    return cfg


def copy_project(dst: Path) -> Path:
    """The repository's files copied to ``dst``, with the shrunk tiny config; returns ``dst``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = REPO / rel
        if src.is_symlink():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            os.symlink(os.readlink(src), dst / rel)
        elif src.is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / rel)
    (dst / TINY_CFG).write_text(toml_text(_tiny_config(dst)))
    return dst


def newcomer_env(project: Path) -> dict:
    """The environment of a user in ``project``: the venv's ``python``/``mlflow`` first on PATH, the
    copy's ``grpo_core`` importable, Metaflow's local defaults in the copy, no tracking URI set."""
    state = project.parent / "state"
    for d in ("mfhome", "tmp", "work"):
        (state / d).mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("MLFLOW_", "METAFLOW_", "GRPO_", "AWS_"))}
    env.update(PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}", PYTHONPATH=str(project), USERNAME="newcomer",
               METAFLOW_HOME=str(state / "mfhome"), METAFLOW_DEFAULT_DATASTORE="local",
               METAFLOW_DEFAULT_METADATA="local", METAFLOW_DATASTORE_SYSROOT_LOCAL=str(project),
               METAFLOW_TEMPDIR=str(state / "tmp"), GRPO_WORK_DIR=str(state / "work"), GSM8K_DIR=str(GSM8K_DIR),
               BROWSER=f"{sys.executable} {REPO / 'tests' / 'record_url.py'} {state / 'opened.txt'} %s")
    return env


def typed(cmd: str, project: Path, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """``cmd`` run by bash in ``project`` as a user types it (stdout and stderr together)."""
    return subprocess.run(["bash", "-c", cmd], cwd=project, env=env or newcomer_env(project), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


# ---------------------------------------------------------------- what a command is for

KINDS = ("run", "resume", "card view", "card server", "card get", "mlflow ui", "registry compare", "evaluate",
         "kubernetes")
NEEDED = ("run", "resume", "card view", "card get", "mlflow ui", "registry compare", "evaluate")
"""The kinds of command README must show (in a fenced block) for a newcomer's first session."""


def kind_of(cmd: Command) -> str | None:
    """What ``cmd`` is for, read from its verbs (not from module paths, which may move); None: unknown."""
    w = cmd.words
    if w[:2] == ["mlflow", "ui"]:
        return "mlflow ui"
    if w[:2] == ["python", "flows/grpo_flow.py"]:
        if "kubernetes" in cmd.text:  # a cluster's commands: checked offline by test_flow.py's spec tests
            return "kubernetes"
        for verbs in (["card", "view"], ["card", "server"], ["card", "get"]):
            if any(w[i:i + 2] == verbs for i in range(len(w))):
                return " ".join(verbs)
        return next((v for v in ("resume", "run") if v in w), None)
    if w[:2] == ["python", "-m"] and len(w) > 2 and w[2].startswith("grpo_core"):
        if "compare" in w:
            return "registry compare"
        if "evaluat" in w[2]:
            return "evaluate"
    return None


def with_tiny_config(cmd: Command) -> str:
    """A run command with the tiny config in place of the one it names (or of the local default)."""
    w = cmd.words
    if "--config" in w:
        i = w.index("--config")
        w = w[:i] + w[i + 3:]
    i = w.index("flows/grpo_flow.py") + 1
    return " ".join(w[:i] + ["--config", "cfg", TINY_CFG] + w[i:])


class Project:
    """The copied project of one test session, with README's run done once (``run``)."""

    def __init__(self, root: Path, sqlite_template: Path | None = None):
        self.dir = copy_project(root / "project")
        self.env = newcomer_env(self.dir)
        self.opened = root / "state" / "opened.txt"  # URLs ``card view`` asked the browser to open
        if sqlite_template is not None:  # an empty migrated store: MLflow's migrations, done once per session
            db = self.dir / ".grpo" / "mlflow" / "mlflow.db"
            db.parent.mkdir(parents=True)
            shutil.copyfile(sqlite_template, db)
        self._runs: dict[str, subprocess.CompletedProcess] = {}
        self._servers: dict[str, tuple[str, subprocess.Popen]] = {}
        self.first_run_id = ""  # set once README's run has run

    @property
    def tracking_uri(self) -> str:
        return f"sqlite:///{self.dir / '.grpo' / 'mlflow' / 'mlflow.db'}"

    def typed(self, cmd: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return typed(cmd, self.dir, timeout, self.env)

    def run(self, cmd: Command) -> subprocess.CompletedProcess:
        """README's run command ``cmd`` with the tiny config, typed once per distinct text."""
        text = with_tiny_config(cmd)
        if text not in self._runs:
            self._runs[text] = self.typed(text, timeout=1800)
        return self._runs[text]

    def latest_run_id(self) -> str:
        return (self.dir / ".metaflow" / "GRPOFlow" / "latest_run").read_text().strip()

    def mlflow_ui(self, cmd: Command) -> str:
        """README's ``mlflow ui`` command started once (on a free port), answering; its URL."""
        from tests.conftest import free_port, wait_http

        if cmd.text not in self._servers:
            log = open(self.dir.parent / "state" / "mlflow-ui.log", "ab")
            port = free_port()
            proc = subprocess.Popen(["bash", "-c", with_port(cmd.text, port)], cwd=self.dir, env=self.env,
                                    stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            self._servers[cmd.text] = (f"http://127.0.0.1:{port}", proc)
            wait_http(f"http://127.0.0.1:{port}/health", 300, proc)  # 4 workers on a busy CI box
        return self._servers[cmd.text][0]

    def close(self) -> None:
        from tests.conftest import stop_group

        for _, proc in self._servers.values():
            stop_group(proc)


def with_port(text: str, port: int) -> str:
    """``text`` with ``port`` in place of the ``--port`` it names (or added)."""
    new, n = re.subn(r"--port[ =]\d+", f"--port {port}", text)
    return new if n else f"{text} --port {port}"
