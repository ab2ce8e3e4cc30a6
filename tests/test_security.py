"""Security properties, tried for real: no pickle or remote code runs on load, and credentials in
the environment never reach MLflow, Metaflow artifacts, logs, cards or files of a flow run."""
from __future__ import annotations

import base64
import gzip
import json
import re
import shutil
import uuid
from pathlib import Path

import pytest
import torch

from grpo_core.config.pipeline import PipelineConfig
from grpo_core.config.stage import GRPOConfig
from grpo_core.model.loading import load_policy
from grpo_core.train import checkpoint


class CodeOnUnpickle:
    """A pickle payload: unpickling it runs ``exec`` and writes ``marker``."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('pwned')",)


def _payload(path: Path, marker: Path) -> None:
    """Write the payload with torch.save and prove it is live (unpickling it runs the code)."""
    torch.save(CodeOnUnpickle(marker), path)
    torch.load(path, weights_only=False)  # what an unsafe loader would do
    assert marker.exists(), "the payload should run code when unpickled without weights_only"
    marker.unlink()



def test_pickle_weights_are_refused_without_unpickling(tiny, tmp_path):
    d, marker = tmp_path / "bin-only", tmp_path / "PWNED"
    shutil.copytree(tiny, d)
    (d / "model.safetensors").unlink()
    _payload(d / "pytorch_model.bin", marker)
    with pytest.raises(ValueError, match=r"no \*\.safetensors weights \(found \['pytorch_model\.bin'\]\).*refused"):
        load_policy(str(d))
    assert not marker.exists()
    # transformers itself, asked for safetensors only, refuses the directory too
    from transformers import AutoModelForCausalLM
    with pytest.raises(OSError, match="model.safetensors"):
        AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)
    assert not marker.exists()


def test_checkpoint_pickle_with_a_matching_manifest_does_not_run(tmp_path):
    """A tampered optimizer.pt whose manifest entry was updated too (so the checksum passes)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    ckpt = checkpoint.save(tmp_path / "ckpts", 2, model, opt, sched, {})
    marker = tmp_path / "PWNED"
    _payload(ckpt / "optimizer.pt", marker)
    manifest = json.loads((ckpt / "manifest.json").read_text())
    manifest["optimizer.pt"] = {"size": (ckpt / "optimizer.pt").stat().st_size,
                                "sha256": checkpoint.storage.sha256_file(ckpt / "optimizer.pt")}
    (ckpt / "manifest.json").write_text(json.dumps(manifest))
    assert checkpoint.verify(ckpt)  # integrity is not authenticity: the load itself must refuse
    with pytest.raises(ValueError, match=r"refused to load .*optimizer\.pt.*tampered"):
        checkpoint.load(ckpt, model, opt, sched)
    assert not marker.exists()


def test_remote_code_is_not_executed_unless_configured(tiny, tmp_path):
    d, marker = tmp_path / "remote", tmp_path / "PWNED"
    shutil.copytree(tiny, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="evil", architectures=["EvilForCausalLM"],
               auto_map={"AutoConfig": "configuration_evil.EvilConfig",
                         "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})
    (d / "config.json").write_text(json.dumps(cfg))
    for f in ("configuration_evil.py", "modeling_evil.py"):
        (d / f).write_text(f"open({str(marker)!r}, 'w').write('pwned')\n")
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        load_policy(str(d))
    assert not marker.exists()
    assert GRPOConfig().trust_remote_code is False
    assert PipelineConfig().stage("gsm8k", model="m").trust_remote_code is False


# ---------------------------------------------------------------- credentials after a flow run

SECRET = f"FAKE-SECRET-{uuid.uuid4().hex[:12]}"
SECRET_ENV = {name: f"{SECRET}-{name}" for name in (
    "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "HF_TOKEN", "MLFLOW_TRACKING_PASSWORD",
    "MLFLOW_TRACKING_TOKEN", "GITHUB_TOKEN", "OPENAI_API_KEY")}


def _hits(where: str, text: str, needles) -> list[tuple[str, str]]:
    """(needle, 'where: ...context...') for every occurrence of every needle in text."""
    return [(n, f"{where}: ...{text[max(0, m.start() - 80):m.end() + 20]}...")
            for n in needles for m in re.finditer(re.escape(n), text)]


def _file_text(path: Path) -> str:
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # Metaflow's local datastore gzips its blobs
        try:
            data = gzip.decompress(data)
        except OSError:
            pass
    return data.decode("latin-1")


def test_env_credentials_never_reach_mlflow_metaflow_logs_or_cards(tmp_path):
    """One tiny flow run with fake secrets in its environment, then every channel is scanned.
    A control string (the config name, which is meant to be logged) must be found in each
    channel, so a scan that cannot see (undecoded gzip/base64, wrong store) fails the test."""
    from tests.flow_helpers import run_flow, tiny_config

    control = f"cfg-{uuid.uuid4().hex[:8]}"
    cfg = tiny_config(tmp_path, name=control, sft={"steps": 10},
                      curriculum={"iterations": 1, "checkpoint": {"every": 1}, "validation": {"every": 1, "size": 4}},
                      gsm8k={"iterations": 1, "checkpoint": {"every": 1}, "validation": {"size": 4}},
                      evaluate={"gsm8k": {"size": 4}, "arithmetic": {"size": 8}, "max_new_tokens": 8})
    result = run_flow(tmp_path, cfg, AWS_ACCESS_KEY_ID="FAKEKEYID", **SECRET_ENV)
    assert result.status == "successful", result.stderr[-5000:]
    scan_for_secrets(tmp_path, cfg["tracking_uri"], result.run, result.stdout + result.stderr, control)
    planted = f"{result.stdout}\n[stage] token={SECRET}\n{result.stderr}"  # the scan catches what it looks for
    with pytest.raises(AssertionError, match=r"runner output: .*token="):
        scan_for_secrets(tmp_path, cfg["tracking_uri"], result.run, planted, control)


LOG_CONTROL = "95% CI"  # the end step prints its stage table: a log read back empty lacks it


def scan_for_secrets(root: Path, tracking_uri: str, run, output: str, control: str) -> None:
    """Fails naming where SECRET appears; also fails when a channel could not be read (its control
    string is missing), so an empty log or an undecoded blob cannot pass."""
    needles = (SECRET, control, "informative", LOG_CONTROL)
    channels = {"output": _hits("runner output", output, needles),
                "mlflow": _scan_mlflow(tracking_uri, needles),
                **_scan_metaflow(run, needles),
                "files": _scan_files(root, needles)}
    leaks = [where for hits in channels.values() for n, where in hits if n == SECRET]
    assert not leaks, "\n".join(leaks[:20])
    for channel in ("mlflow", "artifacts", "files"):
        assert any(n == control for n, _ in channels[channel]), f"control string not seen in {channel}"
    assert any(n == "informative" and "decoded" in w for n, w in channels["cards"]), "card data not decoded"
    assert any(n == control and ".metaflow/" in w for n, w in channels["files"]), "datastore blobs not read"
    for channel in ("logs", "output"):
        assert any(n == LOG_CONTROL for n, _ in channels[channel]), f"the end step's table not seen in {channel}"


def _scan_mlflow(uri: str, needles) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert len(runs) >= 6  # the parent + load_sft, curriculum, gsm8k, evaluate, register
    hits = []
    for r in runs:
        where = f"mlflow run {r.info.run_name}"
        hits += _hits(f"{where} params", json.dumps(r.data.params), needles)
        hits += _hits(f"{where} tags", json.dumps(r.data.tags), needles)
        hits += _hits(f"{where} inputs", repr(r.inputs), needles)
    return hits


def _scan_metaflow(run, needles) -> dict:
    from metaflow.cards import get_cards
    from metaflow.plugins.cards.exception import CardNotPresentException

    out = {"artifacts": [], "logs": [], "cards": []}
    for step in run:
        for task in step:
            for art in task.artifacts:
                out["artifacts"] += _hits(f"artifact {task.pathspec}/{art.id}", repr(art.data), needles)
            out["logs"] += _hits(f"{task.pathspec} stdout", task.stdout or "", needles)
            out["logs"] += _hits(f"{task.pathspec} stderr", task.stderr or "", needles)
            try:
                cards = list(get_cards(task))
            except CardNotPresentException:
                continue
            for card in cards:
                html = card.get()
                blobs = re.findall(r'__MF_DATA__\["[^"]+"\] = "([A-Za-z0-9+/=]+)"', html)
                decoded = "".join(base64.b64decode(b).decode("latin-1") for b in blobs)
                out["cards"] += _hits(f"card {task.pathspec} html", html, needles)
                out["cards"] += _hits(f"card {task.pathspec} decoded", decoded, needles)
    return out


def _scan_files(root: Path, needles) -> list:
    """Every file the run left: datastore blobs (gunzipped), MLflow db and artifacts, checkpoints,
    stage configs, metrics."""
    hits, n_files = [], 0
    for f in root.rglob("*"):
        if f.is_file() and not f.is_symlink():
            hits += _hits(f"file {f.relative_to(root)}", _file_text(f), needles)
            n_files += 1
    assert n_files > 50, n_files
    return hits
