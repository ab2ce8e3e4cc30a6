"""Shared fixtures: real local services (MLflow server, moto S3) started as process groups.

Services are real processes, not mocks. Each runs in its own session (``start_new_session``)
so teardown can kill the whole group: ``mlflow server`` forks a uvicorn worker that would
otherwise outlive it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest
import typing_extensions

# Metaflow's Runner API loads Metaflow's vendored, older typing_extensions, which re-patches
# typing._collect_parameters; torch modules imported after it (DTensor, which transformers loads
# with a model class) then fail with "Type parameter ... without a default follows type parameter
# with a default" (Netflix/metaflow#2462). Tests drive flows through the Runner in this process, so
# the vendored name is bound to the installed typing_extensions before Metaflow can load its own.
if sys.modules.setdefault("metaflow._vendor.typing_extensions", typing_extensions) is not typing_extensions:
    raise RuntimeError("Metaflow's vendored typing_extensions was loaded before tests/conftest.py (by a pytest "
                       "plugin?): the alias cannot take effect; see Netflix/metaflow#2462")

BIN = Path(sys.executable).parent  # the venv's console scripts: mlflow, moto_server
MLFLOW_START_TIMEOUT_S = 90  # ~12 s on a 2-core box with a new db; leave room for a busy CI
S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
          "AWS_DEFAULT_REGION": "us-east-1"}


# ---------------------------------------------------------------- helpers


def free_port() -> int:
    """A TCP port that was free a moment ago on 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    """Poll ``url`` until it answers (any HTTP status); fail clearly on timeout or early exit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process for {url} exited early with code {proc.returncode}")
        try:
            urllib.request.urlopen(url, timeout=2).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.25)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f} s")


def stop_group(proc: subprocess.Popen, sig: int = signal.SIGTERM) -> None:
    """Signal the whole process group of a service, wait for it, then SIGKILL any straggler."""
    for s in (sig, signal.SIGKILL):
        try:
            os.killpg(proc.pid, s)
        except ProcessLookupError:
            break
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
    proc.wait()


@dataclass
class Service:
    url: str
    port: int
    proc: subprocess.Popen
    log: Path

    def stop(self, sig: int = signal.SIGTERM) -> None:
        stop_group(self.proc, sig)

    def log_tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def start_mlflow_server(workdir: Path, port: int | None = None, db: Path | None = None,
                        artifacts: str | None = None, env: dict | None = None) -> Service:
    """Start ``mlflow server`` (sqlite backend, proxied artifacts) and wait for /health."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    db = db or workdir / "mlflow.db"
    artifacts = artifacts or str(workdir / "mlartifacts")
    log = workdir / f"mlflow-server-{port}.log"
    cmd = [str(BIN / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
           "--workers", "1", "--backend-store-uri", f"sqlite:///{db}",
           "--artifacts-destination", artifacts]
    full_env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, cwd=workdir, env=full_env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    svc = Service(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        wait_http(svc.url + "/health", MLFLOW_START_TIMEOUT_S, proc)
    except (RuntimeError, TimeoutError) as e:
        svc.stop()
        pytest.fail(f"mlflow server did not start: {e}\n--- {log} ---\n{svc.log_tail()}")
    return svc


def start_moto(workdir: Path) -> Service:
    """Start ``moto_server`` (in-memory S3, no auth) on a free port."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = workdir / f"moto-{port}.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([str(BIN / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                                cwd=workdir, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    svc = Service(f"http://127.0.0.1:{port}", port, proc, log)
    try:
        wait_http(svc.url, 30, proc)
    except (RuntimeError, TimeoutError) as e:
        svc.stop()
        pytest.fail(f"moto_server did not start: {e}\n{svc.log_tail()}")
    return svc


# ---------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """URI of a real MLflow server shared by the session (sqlite backend, local artifacts)."""
    svc = start_mlflow_server(tmp_path_factory.mktemp("mlflow-server"))
    yield svc.url
    svc.stop()


@pytest.fixture
def mlflow_servers(tmp_path):
    """Factory for dedicated servers (outage tests, other artifact stores); all stopped after."""
    started: list[Service] = []

    def start(**kwargs) -> Service:
        kwargs.setdefault("workdir", tmp_path / "srv")
        svc = start_mlflow_server(**kwargs)
        started.append(svc)
        return svc

    yield start
    for svc in started:
        svc.stop()


@pytest.fixture
def no_cwd_writes(tmp_path, monkeypatch):
    """Run in an empty cwd and fail if anything lands there (MLflow defaults write ./mlflow.db, ./mlruns)."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    yield
    assert not list(cwd.iterdir()), f"files written to the cwd: {sorted(p.name for p in cwd.iterdir())}"


@pytest.fixture(scope="session")
def _sqlite_template(tmp_path_factory) -> Path:
    """An empty, fully migrated MLflow sqlite db: creating the schema costs ~2 s, a copy ~0.05 s."""
    from mlflow import MlflowClient

    db = tmp_path_factory.mktemp("sqlite-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def sqlite_uri(tmp_path, _sqlite_template) -> str:
    """A fresh sqlite tracking URI in the test's tmp dir (absolute path: four slashes)."""
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    shutil.copyfile(_sqlite_template, db)
    return f"sqlite:///{db}"


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory):
    """Endpoint URL of a moto S3 server; credentials in ``S3_ENV`` (moto does not check them)."""
    svc = start_moto(tmp_path_factory.mktemp("moto"))
    yield svc.url
    svc.stop()


@pytest.fixture
def s3_env(monkeypatch, s3_server) -> dict:
    """Point boto3 (and MLflow's S3 client) at moto for this test."""
    env = {**S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3_server, "AWS_ENDPOINT_URL_S3": s3_server}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A saved 2-layer, hidden-64 Llama with the character tokenizer (shared by the trainer tests)."""
    from tests.helpers import tiny_model_dir

    return tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="session")
def newcomer(tmp_path_factory, _sqlite_template):
    """A copy of the project after README's run command (tiny config), typed once per session;
    README's commands and the browser tests look at what it left (tests/newcomer.py)."""
    from tests.helpers import REPO, require_gsm8k
    from tests.newcomer import Project, kind_of, readme_commands

    runs = [c for c in readme_commands((REPO / "README.md").read_text()) if kind_of(c) == "run"]
    if not runs:
        pytest.fail("README shows no `python flows/grpo_flow.py ... run` command in a fenced code block",
                    pytrace=False)
    require_gsm8k()
    project = Project(tmp_path_factory.mktemp("newcomer"), _sqlite_template)
    done = project.run(runs[0])
    if done.returncode != 0:
        pytest.fail(f"README's run command (line {runs[0].line}, tiny config) failed:\n{done.stdout[-5000:]}",
                    pytrace=False)
    project.first_run_id = project.latest_run_id()
    yield project
    project.close()


@pytest.fixture(scope="session")
def browser():
    """A headless Chromium (tests/browser.py); a missing chromium, chromedriver or selenium fails."""
    from tests.browser import open_browser

    driver = open_browser()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """A moto S3 server per test module, with a bucket 'ckpts': its request log shows the order of uploads."""
    import boto3

    svc = start_moto(tmp_path_factory.mktemp("moto-reliability"))
    boto3.client("s3", endpoint_url=svc.url, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="ckpts")
    yield svc
    svc.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    """A boto3 client of ``moto``; the environment points grpo_core's storage at it for this test."""
    import boto3

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", moto.url)
    return boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")



@pytest.fixture(scope="session")
def smol_cache(tmp_path_factory) -> tuple[Path, dict]:
    """The packaged SmolLM2 converted once per session (``io.gguf``): (cache root, convert_gguf's
    record). Without the package the tests that use it fail and say how to install it."""
    from grpo_core.io import gguf
    from tests.helpers import PACKAGED
    cache = tmp_path_factory.mktemp("smollm2-cache")
    try:
        return cache, gguf.convert_gguf(PACKAGED, str(cache))
    except (FileNotFoundError, ImportError) as exc:
        pytest.fail(f"the real-model tests need the packaged SmolLM2: {exc}", pytrace=False)
