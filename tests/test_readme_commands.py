"""README's commands, typed as a newcomer types them after the first run.

The commands are read from README's fenced code blocks when the tests are collected (lines, or
``&&`` segments, starting with ``python flows/grpo_flow.py``, ``python -m grpo_core`` or
``mlflow ui``), so a module, subcommand or flag renamed on one side only fails here. Each runs in
a copy of the project (``tests/newcomer.py``) after one tiny run of README's run command; what a
command is for is read from its verbs, and what it prints is checked against the stores the run
wrote. Deviations from the text, all for CI: a run gets the tiny config, ``mlflow ui`` a free port,
``<run id>`` the run's id, and the Kubernetes commands (a cluster's) are left to
``test_flow.py``'s offline spec tests.
"""
import json
import re
import signal
import subprocess
import tomllib
import urllib.request

import pytest

from tests.conftest import stop_group, wait_http
from tests.helpers import REPO
from tests.newcomer import NEEDED, TINY_CFG, Command, kind_of, readme_commands

COMMANDS = readme_commands((REPO / "README.md").read_text())
ORDER = {"run": 0, "resume": 2}  # the run first; resume last: the others read the first run
TYPED = sorted((c for c in COMMANDS if kind_of(c) not in (None, "kubernetes")),
               key=lambda c: ORDER.get(kind_of(c), 1))

def test_readme_shows_every_command_a_newcomer_needs():
    unknown = [c.text for c in COMMANDS if kind_of(c) is None]
    assert not unknown, f"README shows commands this test does not know how to check: {unknown} (tests/newcomer.py)"
    missing = [k for k in NEEDED if k not in {kind_of(c) for c in COMMANDS}]
    assert not missing, f"README shows no {missing} command in a fenced code block"

@pytest.mark.parametrize("cmd", TYPED, ids=[f"L{c.line}: {c.text}" for c in TYPED])
def test_readme_command_works_as_written(cmd: Command, newcomer):
    CHECKS[kind_of(cmd)](newcomer, cmd)

def _filled(newcomer, cmd: Command) -> str:
    """The command with README's placeholders filled; an unknown placeholder fails the test."""
    text = cmd.text.replace("<run id>", newcomer.first_run_id)
    left = re.findall(r"<[^<>]+>", text)
    assert not left, f"README line {cmd.line}: placeholder {left} the test cannot fill: {cmd.text}"
    return text

def _typed_ok(newcomer, text: str, timeout: float = 300) -> str:
    done = newcomer.typed(text, timeout)
    assert done.returncode == 0, f"`{text}` exited {done.returncode}:\n{done.stdout[-4000:]}"
    return done.stdout

def check_run(newcomer, cmd: Command) -> None:
    done = newcomer.run(cmd)
    assert done.returncode == 0, done.stdout[-5000:]
    with open(newcomer.dir / TINY_CFG, "rb") as f:
        model = tomllib.load(f)["register"]["model_name"]
    assert re.search(rf"registry: {re.escape(model)} v\d+ -> (promoted|challenger|first)", done.stdout), \
        done.stdout[-3000:]
    assert "Done!" in done.stdout

def check_resume(newcomer, cmd: Command) -> None:
    """The origin run succeeded, so resume clones every step (the crash + resume path itself is
    test_flow.py's); it must still find the latest run, clone it and finish."""
    origin = newcomer.latest_run_id()
    out = _typed_ok(newcomer, _filled(newcomer, cmd), timeout=900)
    assert f"Cloning GRPOFlow/{origin}" in out and "Done!" in out, out[-3000:]

def _card_text(html: str) -> str:
    """The JSON a Metaflow card embeds (base64 in its self-contained HTML), as text."""
    import base64

    blobs = re.findall(r'__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', html)
    assert blobs, "card has no embedded data"
    return "".join(base64.b64decode(b).decode() for b in blobs)

def check_card_view(newcomer, cmd: Command) -> None:
    """`card view` opens the card in the user's browser (``BROWSER``: tests/record_url.py)."""
    newcomer.opened.unlink(missing_ok=True)
    _typed_ok(newcomer, _filled(newcomer, cmd))
    [url] = newcomer.opened.read_text().split()
    path = url.removeprefix("file://")
    data = _card_text(open(path).read())
    step = cmd.words[cmd.words.index("view") + 1]
    assert step.removesuffix("_grpo") in data and "informative" in data, data[:2000]

def check_card_server(newcomer, cmd: Command) -> None:
    m = re.search(r"--port[ =](\d+)", cmd.text)
    url = f"http://localhost:{m.group(1) if m else 8324}"  # Metaflow's default port
    proc = subprocess.Popen(["bash", "-c", _filled(newcomer, cmd)], cwd=newcomer.dir, env=newcomer.env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_http(url, 120, proc)
        with urllib.request.urlopen(f"{url}/runinfo", timeout=60) as r:  # the run it serves, its cards
            runs = json.load(r)
        assert newcomer.latest_run_id() in json.dumps(runs), runs  # the latest run, as `card view`
    finally:
        stop_group(proc, signal.SIGINT)

def check_card_get(newcomer, cmd: Command) -> None:
    text = _filled(newcomer, cmd)
    out_file = newcomer.dir / cmd.words[-1]
    out_file.unlink(missing_ok=True)
    _typed_ok(newcomer, text)
    data = _card_text(out_file.read_text())
    card_id = cmd.words[cmd.words.index("--id") + 1]
    assert {"evaluation": "Held-out accuracy", "training": "informative", "registry": "Registry"}[card_id] in data

def check_mlflow_ui(newcomer, cmd: Command) -> None:
    """The UI README starts opens the store the run wrote: the run's experiment is in it."""
    with open(newcomer.dir / TINY_CFG, "rb") as f:
        experiment = tomllib.load(f)["experiment"]
    url = newcomer.mlflow_ui(cmd)
    with urllib.request.urlopen(f"{url}/api/2.0/mlflow/experiments/get-by-name?experiment_name={experiment}",
                                timeout=30) as r:
        exp = json.load(r)["experiment"]
    body = json.dumps({"experiment_ids": [exp["experiment_id"]], "max_results": 50}).encode()
    req = urllib.request.Request(f"{url}/api/2.0/mlflow/runs/search", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        runs = json.load(r)["runs"]
    assert any(t["value"].endswith(newcomer.first_run_id) for r in runs for t in r["data"].get("tags", [])), runs

def check_registry_compare(newcomer, cmd: Command) -> None:
    """The version table (every version with its aliases); with --a/--b the paired comparison.
    The one run registered one version: versions the command names beyond it are copies of it."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=newcomer.tracking_uri)
    name = cmd.words[cmd.words.index("compare") + 1]
    pair = [int(v) for v in re.findall(r"--[ab][ =](\d+)", cmd.text)]
    while max(pair, default=0) > len(client.search_model_versions(f"name='{name}'")):
        client.copy_model_version(f"models:/{name}/1", name)
    out = _typed_ok(newcomer, _filled(newcomer, cmd))
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.split()[:2] == ["version", "aliases"])
    rows = {line.split()[0]: line.split()[1] for line in lines[header + 1:] if line.split()[:1] and
            line.split()[0].isdigit()}
    versions = [client.get_model_version(name, v.version) for v in client.search_model_versions(f"name='{name}'")]
    assert set(rows) == {str(v.version) for v in versions}, out  # (a search leaves aliases out)
    for v in versions:
        assert set(rows[str(v.version)].split(",")) == set(v.aliases or ["-"]), (v.version, v.aliases, out)
    if pair:
        assert re.search(rf"v{pair[0]}=[\d.]+ +v{pair[1]}=[\d.]+", out) and "McNemar" in out, out

def check_evaluate(newcomer, cmd: Command) -> None:
    out = _typed_ok(newcomer, _filled(newcomer, cmd), timeout=600)
    result = json.loads(out.strip().splitlines()[-1])
    w = cmd.words
    if "--set" in w:
        assert result["set"] == w[w.index("--set") + 1]
    if "--size" in w:
        assert result["n"] == int(w[w.index("--size") + 1])
    assert result["correct"] == round(result["accuracy"] * result["n"])
    assert result["ci_low"] <= result["accuracy"] <= result["ci_high"]

CHECKS = {"run": check_run, "resume": check_resume, "card view": check_card_view, "card server": check_card_server,
          "card get": check_card_get, "mlflow ui": check_mlflow_ui, "registry compare": check_registry_compare,
          "evaluate": check_evaluate}

def test_mlflow_ui_port_is_replaced_only_when_readme_names_one():
    """The one edit to README's mlflow ui command: a free port in place of the one it names."""
    from tests.newcomer import with_port

    assert with_port("mlflow ui --host 127.0.0.1 --port 5000 --x", 1234) == "mlflow ui --host 127.0.0.1 --port 1234 --x"
    assert with_port("mlflow ui --backend-store-uri sqlite:///db", 1234) == \
        "mlflow ui --backend-store-uri sqlite:///db --port 1234"
