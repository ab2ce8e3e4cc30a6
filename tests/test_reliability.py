"""Faults injected for real: killed processes, torn and corrupt checkpoints, non-finite updates,
S3 errors (a real moto server, a real connection-dropping proxy), a full disk (RLIMIT_FSIZE),
and bad inputs. Each test checks that nothing is lost and that errors name what to fix.
docs/reliability.md maps every fault to its test.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file, save_file

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig, deep_merge
from grpo_core.io import storage
from grpo_core.train import checkpoint
from grpo_core.train.entry import main
from grpo_core.train.trainer import NonFiniteError
from tests import faulty_rewards
from tests.conftest import S3_ENV, free_port, start_moto
from tests.faults import InjectedFault, crash_after_iteration
from tests.helpers import REPO, SEVENS, same_weights, stage_args

TORCHRUN_TIMEOUT_S = 240



def _stage(tiny, out, **kw) -> list[str]:
    base = dict(runtime=dict(model=str(tiny), output_dir=str(out)), rewards=SEVENS, iterations=4, optim=dict(lr=3e-3),
                loss=dict(beta=0.0), prompts_per_iter=4, sampling=dict(group_size=4, max_new_tokens=8),
                checkpoint=dict(every=2))
    return stage_args(**deep_merge(base, kw))


def _iterations(out: Path) -> list[int]:
    f = out / "metrics.jsonl"
    return [json.loads(ln)["iteration"] for ln in f.read_text().splitlines()] if f.exists() else []


def _small_state(seed: int = 0):
    """A real model/optimizer/scheduler triple, small enough to checkpoint in milliseconds."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    return model, opt, sched


# ---------------------------------------------------------------- 1. killed processes


def _torchrun(tiny, out, log: Path, **kw) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           "-m", "grpo_core.train", *_stage(tiny, out, **kw)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "ab") as f:
        return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def _finish(proc: subprocess.Popen, log: Path) -> int:
    try:
        return proc.wait(timeout=TORCHRUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"torchrun did not finish in {TORCHRUN_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def _wait_for_iteration(proc: subprocess.Popen, out: Path, log: Path, iteration: int) -> None:
    """Until the running stage has logged ``iteration`` (its metrics.jsonl), or fail."""
    deadline = time.monotonic() + TORCHRUN_TIMEOUT_S
    while not any(i >= iteration for i in _iterations(out)):
        assert proc.poll() is None, f"torchrun exited early:\n{log.read_text()[-3000:]}"
        assert time.monotonic() < deadline, f"no iteration {iteration} in time"
        time.sleep(0.05)


def _worker(torchrun_pid: int, rank: int) -> psutil.Process:
    for child in psutil.Process(torchrun_pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank):
                return child
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no torchrun worker with RANK={rank} under pid {torchrun_pid}")


def test_sigkill_of_a_torchrun_worker_then_rerun_resumes_bitwise(tiny, tmp_path):
    """SIGKILL rank 0 (the checkpoint writer) mid-run: torchrun fails, the latest checkpoint
    verifies, the same command resumes, and the weights equal an uninterrupted run's."""
    kw = dict(iterations=8, checkpoint=dict(every=2, keep=2))
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    log = tmp_path / "killed.log"
    proc = _torchrun(tiny, killed, log, **kw)
    _wait_for_iteration(proc, killed, log, 3)
    victim = _worker(proc.pid, rank=0)
    workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.kill(victim.pid, signal.SIGKILL)
    assert _finish(proc, log) != 0
    assert not (killed / "final").exists() and not (killed / "summary.json").exists(), "kill came too late"
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"], \
        "a worker outlived torchrun"
    last = checkpoint.latest_local(killed / "checkpoints")
    assert last is not None and checkpoint.verify(last) and checkpoint.iteration_of(last.name) >= 2
    resumed_at = checkpoint.iteration_of(last.name)

    rerun = _torchrun(tiny, killed, log, **kw)
    straight_proc = _torchrun(tiny, straight, tmp_path / "straight.log", **kw)
    assert _finish(rerun, log) == 0, log.read_text()[-3000:]
    assert _finish(straight_proc, tmp_path / "straight.log") == 0, (tmp_path / "straight.log").read_text()[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from_iteration"] == resumed_at and summary["iterations_run"] == 8
    assert _iterations(killed) == list(range(1, 9))  # iterations after the checkpoint logged once
    assert same_weights(killed / "final", straight / "final")
    assert not list((killed / "checkpoints").glob(".ckpt-*")), "a temp dir survived the next save"


def test_torn_writes_leave_the_last_good_checkpoint_and_prune_cleans_up(tmp_path):
    """What a kill during a checkpoint write can leave: a hidden temp dir, a checkpoint with a
    missing file, a manifest cut short, a manifest of the wrong shape, an empty manifest."""
    root = tmp_path / "checkpoints"
    model, opt, sched = _small_state()
    for it in (2, 4, 6, 8, 10, 12):
        checkpoint.save(root, it, model, opt, sched, {"data_position": it})
    (root / "ckpt-000006" / "optimizer.pt").unlink()                                  # missing file
    (root / "ckpt-000008" / "manifest.json").write_text('{"model.safetensors": {"si')  # torn manifest
    (root / "ckpt-000010" / "manifest.json").write_text('["model.safetensors"]')      # wrong shape
    (root / "ckpt-000012" / "manifest.json").write_text("{}")                         # lists nothing
    torn = root / ".ckpt-000014.x1y2z3"                                                # killed mid-save
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"\0" * 100)

    with pytest.warns(UserWarning) as caught:
        found = checkpoint.latest_local(root)
    assert found == root / "ckpt-000004"
    assert len(caught) == 4  # one warning per damaged checkpoint, newest first
    assert checkpoint.load(found, *_small_state(seed=1))["iteration"] == 4

    checkpoint.prune(root, keep=2)  # damaged ones do not count towards keep
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000002", "ckpt-000004"]


def test_pruning_after_a_save_keeps_it_whatever_newer_leftovers_look_like(tmp_path):
    """ckpt-6 was just written (a resume after ckpt-8 failed its checksum): ckpt-8, complete in
    size but corrupt, must neither evict ckpt-6 nor be deleted here; older ones go past keep."""
    root = tmp_path / "checkpoints"
    model, opt, sched = _small_state()
    for it in (2, 4, 6, 8):
        checkpoint.save(root, it, model, opt, sched, {"data_position": it})
    weights = root / "ckpt-000008" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, other bytes
    weights.write_bytes(bytes(data))
    checkpoint.prune(root, keep=1, written="ckpt-000006")
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000006", "ckpt-000008"]
    checkpoint.prune_stored(str(root), 1, written="ckpt-000006")  # a local sync_uri takes the same path
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000006", "ckpt-000008"]


# ---------------------------------------------------------------- 2. corrupt checkpoint on resume


def test_resume_skips_a_truncated_checkpoint_and_still_matches(tiny, tmp_path):
    main(_stage(tiny, tmp_path, checkpoint=dict(keep=3)))
    reference = tmp_path / "reference"
    shutil.copytree(tmp_path / "final", reference)
    model_file = tmp_path / "checkpoints" / "ckpt-000004" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-64])  # truncated

    with pytest.warns(UserWarning, match="ckpt-000004 is incomplete or corrupt"):
        summary = main(_stage(tiny, tmp_path, checkpoint=dict(keep=3)))
    assert summary["resumed_from_iteration"] == 2 and summary["iterations_run"] == 4
    assert _iterations(tmp_path) == [1, 2, 3, 4]
    assert same_weights(reference, tmp_path / "final")  # redoing 3..4 from ckpt-2 is exact
    assert checkpoint.verify(tmp_path / "checkpoints" / "ckpt-000004")  # rewritten whole


# ---------------------------------------------------------------- 3. non-finite updates


def test_non_finite_updates_are_skipped_then_stop_the_stage(tiny, tmp_path):
    """Rewards of 1e38 with scale='none' overflow the gradient (a real NaN, no mock).
    Call 2 alone: one skip, counted, training goes on. Calls 5-7: three in a row stop the stage."""
    faulty_rewards.reset({2, 5, 6, 7})
    args = _stage(tiny, tmp_path, iterations=8, checkpoint=dict(keep=3), loss=dict(scale="none"),
                  rewards=[{"fn": "tests.faulty_rewards:huge_on_calls"}])
    with pytest.raises(NonFiniteError, match=r"3 non-finite updates in a row.*loss=.*grad_norm=(nan|inf).*intact"):
        main(args)
    rows = {r["iteration"]: r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines())}
    assert sorted(rows) == [1, 2, 3, 4, 5, 6]  # iteration 7 raised before it was recorded
    assert rows[2]["skipped_updates"] == 1 and rows[2]["grad_norm"] != rows[2]["grad_norm"]  # nan
    assert rows[3]["skipped_updates"] == 1 and rows[3]["grad_norm"] == rows[3]["grad_norm"]  # recovered
    assert rows[6]["skipped_updates"] == 3
    assert not (tmp_path / "final").exists()
    ckpts = tmp_path / "checkpoints"
    assert checkpoint.latest_local(ckpts) == ckpts / "ckpt-000006"
    state = json.loads((ckpts / "ckpt-000006" / "state.json").read_text())
    assert state["skipped_updates"] == 3 and state["nonfinite_in_a_row"] == 2
    w4, w6 = (load_file(str(ckpts / n / "model.safetensors")) for n in ("ckpt-000004", "ckpt-000006"))
    assert all(torch.equal(w4[k], w6[k]) and torch.isfinite(w6[k]).all() for k in w4)  # skipped = untouched


def test_nan_in_the_starting_weights_is_refused_naming_the_parameter(tiny, tmp_path):
    bad = tmp_path / "nan-model"
    shutil.copytree(tiny, bad)
    weights = load_file(str(bad / "model.safetensors"))
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, str(bad / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"parameter model\.norm\.weight has 1 NaN/inf values"):
        main(_stage(bad, tmp_path / "out"))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- 4. S3 errors


class DroppingProxy:
    """A TCP proxy to ``port`` that resets its first ``drop`` connections: a real network fault."""

    def __init__(self, port: int, drop: int):
        self.target, self.drop, self.dropped = port, drop, 0
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self):
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            if self.dropped < self.drop:
                self.dropped += 1
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # RST: "connection reset by peer"
                continue
            upstream = socket.create_connection(("127.0.0.1", self.target))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b):
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self):
        self.sock.close()


@pytest.fixture(scope="module")
def moto(tmp_path_factory):
    """A dedicated moto S3 server: its request log shows the order of uploads."""
    import boto3

    svc = start_moto(tmp_path_factory.mktemp("moto-reliability"))
    boto3.client("s3", endpoint_url=svc.url, region_name="us-east-1",
                 aws_access_key_id="testing", aws_secret_access_key="testing").create_bucket(Bucket="ckpts")
    yield svc
    svc.stop()


@pytest.fixture
def s3(moto, monkeypatch):
    import boto3

    for k, v in S3_ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", moto.url)
    return boto3.client("s3", endpoint_url=moto.url, region_name="us-east-1")


def _put_checkpoint(tmp_path, uri_root: str, it: int) -> Path:
    local = checkpoint.save(tmp_path / "local", it, *_small_state(seed=it), {"data_position": it})
    storage.put_dir(local, storage.join(uri_root, local.name))
    return local


def test_s3_missing_bucket_and_missing_prefix_name_the_uri(s3, tmp_path):
    local = checkpoint.save(tmp_path, 1, *_small_state(), {})
    with pytest.raises(RuntimeError, match=r"s3://no-such-bucket/run/ckpt-000001/model\.safetensors.*bucket exists"):
        storage.put_dir(local, "s3://no-such-bucket/run/ckpt-000001")
    with pytest.raises(FileNotFoundError, match="s3://ckpts/nothing/here"):
        storage.get_dir("s3://ckpts/nothing/here", tmp_path / "dl")
    assert storage.list_dirs("s3://ckpts/nothing") == []


def test_s3_checkpoint_sync_writes_manifest_last_and_resumes(s3, moto, tmp_path):
    root = "s3://ckpts/sync-order/checkpoints"
    _put_checkpoint(tmp_path, root, 2)
    time.sleep(0.3)  # let the server's request log catch up
    puts = [ln.split('"PUT /ckpts/sync-order/checkpoints/ckpt-000002/')[1].split(" ")[0]
            for ln in moto.log.read_text().splitlines() if '"PUT /ckpts/sync-order/' in ln]
    assert sorted(puts) == sorted(checkpoint.REQUIRED | checkpoint.WEIGHTS | {"manifest.json"}), puts
    assert puts[-1] == "manifest.json", puts
    found = checkpoint.latest([root], tmp_path / "scratch")
    assert found is not None and checkpoint.verify(found)
    assert checkpoint.load(found, *_small_state(seed=9))["iteration"] == 2


def test_a_rank_on_another_node_fetches_rank_0s_checkpoint_from_storage(s3, tmp_path):
    """Multi-node resume: rank 0 broadcasts the path of the checkpoint it chose on its own disk;
    a rank that cannot see that path loads the same checkpoint from the stage's storage."""
    from types import SimpleNamespace

    from grpo_core.policy.dist import DistInfo
    from grpo_core.train.stage_checkpoints import StageCheckpoints

    stage = "s3://ckpts/other-node"
    _put_checkpoint(tmp_path, storage.join(stage, "checkpoints"), 2)
    _put_checkpoint(tmp_path, storage.join(stage, "checkpoints"), 4)
    cfg = SimpleNamespace(runtime=SimpleNamespace(resume_from=["s3://ckpts/absent-run", stage]))
    node1 = StageCheckpoints(cfg, DistInfo(3, 4, 1, torch.device("cpu")), tmp_path / "node-1")
    chosen_on_node0 = tmp_path / "node-0-disk" / "scratch" / "0123abcd-ckpt-000002"  # not here
    got = node1.readable(chosen_on_node0)
    assert got.name.endswith("ckpt-000002") and "rank-3" in str(got) and checkpoint.verify(got)
    assert checkpoint.load(got, *_small_state(seed=9))["data_position"] == 2  # the one chosen, not the newest
    assert node1.readable(got) == got  # a path this rank sees is used as it is
    with pytest.raises(RuntimeError, match=r"rank 3 cannot read checkpoint ckpt-000006.*s3:// storage_root"):
        node1.readable(tmp_path / "elsewhere" / "ckpt-000006")


def test_s3_put_dir_replaces_what_was_there(s3, tmp_path):
    """A model saved again with another layout: the old files under the prefix are deleted, files
    under a sibling prefix that merely starts alike are not, and a bucket root is refused."""
    first, second = tmp_path / "first", tmp_path / "second"
    (first / "sub").mkdir(parents=True)
    (first / "model.safetensors").write_bytes(b"single")
    (first / "sub" / "old.txt").write_text("old")
    (second / "model-00001-of-00002.safetensors").parent.mkdir()
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "config.json"):
        (second / name).write_text(name)
    storage.put_dir(first, "s3://ckpts/replace/final")
    storage.put_dir(first, "s3://ckpts/replace/final-copy")
    storage.put_dir(second, "s3://ckpts/replace/final")
    keys = lambda p: sorted(o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix=p).get("Contents", []))  # noqa: E731
    assert keys("replace/final/") == [f"replace/final/{n}" for n in (
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")]
    assert keys("replace/final-copy/") == ["replace/final-copy/model.safetensors", "replace/final-copy/sub/old.txt"]
    got = storage.get_dir("s3://ckpts/replace/final", tmp_path / "dl")
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in second.iterdir())
    with pytest.raises(ValueError, match="would replace the whole bucket"):
        storage.put_dir(second, "s3://ckpts")


def test_s3_checkpoint_missing_an_object_is_skipped_with_a_warning(s3, tmp_path):
    root = "s3://ckpts/damaged/checkpoints"
    for it in (2, 4, 6):
        _put_checkpoint(tmp_path, root, it)
    s3.delete_object(Bucket="ckpts", Key="damaged/checkpoints/ckpt-000006/manifest.json")  # died before the manifest
    s3.delete_object(Bucket="ckpts", Key="damaged/checkpoints/ckpt-000004/optimizer.pt")   # lost an object
    with pytest.warns(UserWarning) as caught:
        found = checkpoint.latest([str(tmp_path / "no-local"), root], tmp_path / "scratch")
    msgs = [str(w.message) for w in caught]
    assert any("damaged/checkpoints/ckpt-000006 is incomplete" in m for m in msgs)
    assert any("damaged/checkpoints/ckpt-000004 is incomplete" in m for m in msgs)
    assert checkpoint.load(found, *_small_state(seed=9))["iteration"] == 2
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == [found.name]  # bad downloads removed


def test_s3_folder_markers_are_not_files(s3, tmp_path):
    """A console-made ``prefix/`` marker under a model: downloaded as nothing, not a failure."""
    local = checkpoint.save(tmp_path, 1, *_small_state(), {})
    storage.put_dir(local, "s3://ckpts/markers/models/sft")
    s3.put_object(Bucket="ckpts", Key="markers/models/sft/", Body=b"")
    got = storage.get_dir("s3://ckpts/markers/models/sft", tmp_path / "dl")
    assert sorted(p.name for p in got.iterdir()) == sorted(p.name for p in local.iterdir())


def test_s3_checkpoints_are_pruned_like_local_ones(s3, tmp_path):
    """keep=2 after ckpt 9 was written: 9 and the newest older complete copy (8) stay; older ones
    and a cut-short upload (4, no manifest) go. A damaged leftover newer than 9 (10: manifest there,
    weights lost) is not complete, not counted and not touched, so it can never push 8 and 9 out."""
    root = "s3://ckpts/prune/checkpoints"
    for it in (2, 4, 6, 8, 10, 9):
        _put_checkpoint(tmp_path, root, it)
    s3.delete_object(Bucket="ckpts", Key="prune/checkpoints/ckpt-000004/manifest.json")
    s3.delete_object(Bucket="ckpts", Key="prune/checkpoints/ckpt-000010/model.safetensors")
    assert not checkpoint.stored_complete(storage.join(root, "ckpt-000010"))
    checkpoint.prune_stored(root, 2, written="ckpt-000009")
    assert storage.list_dirs(root) == ["ckpt-000008", "ckpt-000009", "ckpt-000010"]
    assert checkpoint.stored_complete(storage.join(root, "ckpt-000008"))
    found = checkpoint.latest([root], tmp_path / "scratch")
    assert found is not None and found.name.endswith("ckpt-000009")


def test_s3_transient_connection_resets_are_retried(s3, moto, tmp_path, monkeypatch):
    proxy = DroppingProxy(moto.port, drop=2)
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", proxy.url)
    try:
        _put_checkpoint(tmp_path, "s3://ckpts/flaky/checkpoints", 2)
        found = checkpoint.latest(["s3://ckpts/flaky/checkpoints"], tmp_path / "scratch")
    finally:
        proxy.close()
    assert proxy.dropped == 2 and checkpoint.verify(found)


# ---------------------------------------------------------------- 5. tracking server down


def test_training_completes_while_the_mlflow_server_is_down(tiny, tmp_path, monkeypatch):
    """Nothing listens at the tracking URI (a dead server: connection refused on every call).
    The retry budget is shortened from 5 tries with 0.5 s backoff (15.5 s per flush) to keep
    the test fast; the tracker and the failures are real."""
    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    dead = f"http://127.0.0.1:{free_port()}"
    summary = main(_stage(tiny, tmp_path, runtime=dict(tracking_uri=dead, tracking_run_id="0" * 32)))
    assert summary["iterations_run"] == 4 and (tmp_path / "final" / "model.safetensors").exists()
    assert summary["tracking_delayed_points"] > 0
    spill = [json.loads(ln) for ln in (tmp_path / "pending_metrics.jsonl").read_text().splitlines()]
    assert sorted({r["step"] for r in spill if r["kind"] == "metric" and r["key"] == "reward"}) == [1, 2, 3, 4]
    # params wait for the server too (sent if the run lacks them: a rerun of the step reuses its run)
    assert any(r["kind"] == "param_if_absent" and r["key"] == "optim.lr" for r in spill)


def test_an_outage_then_a_crash_loses_no_point_and_no_param(tiny, tmp_path, monkeypatch):
    """MLflow down for the first attempt, which crashes after its checkpoint at iteration 2: the
    points it held back lived only in its memory. The resumed attempt, with the store back and a
    fresh output dir (a flow ``resume``), resends the restored history with its first timestamps
    and logs the params the run does not hold, so every iteration and every param arrives, each
    point once, also when the history is resent a second time."""
    from mlflow import MlflowClient

    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage-crash")).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"
    with crash_after_iteration(3), pytest.raises(InjectedFault):
        main(_stage(tiny, tmp_path / "a",
                    runtime=dict(tracking_uri=dead, tracking_run_id=run_id, sync_uri=str(tmp_path / "store"))))
    client.log_param(run_id, "runtime.output_dir", "first attempt's")  # as if it had reached the store
    for attempt, origin in (("b", "store"), ("c", "b/store")):  # c resumes b's finished stage: a resend only
        main(_stage(tiny, tmp_path / attempt, runtime=dict(
            tracking_uri=store, tracking_run_id=run_id, resume_from=[str(tmp_path / origin)],
            sync_uri=str(tmp_path / attempt / "store"))))
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward")) == [1, 2, 3, 4]
    params = client.get_run(run_id).data.params
    assert params["optim.lr"] == "0.003" and params["runtime.output_dir"] == "first attempt's"
    assert "objective.normaliser" in params


def test_points_kept_during_an_outage_are_replayed_by_a_later_step(tiny, tmp_path, monkeypatch):
    """MLflow unreachable for a whole stage (a dead address), the stage's run in a real store: the
    stage keeps its unsent points beside its checkpoints (a training pod's scratch would die with
    it) and the flow's ``end`` step (``pipeline.replay_tracking``) sends them once the store is
    reachable, each once even when replayed twice."""
    from mlflow import MlflowClient

    from grpo_core.pipeline.steps import replay_tracking
    from grpo_core.tracking.logger import MlflowTracker

    monkeypatch.setattr(MlflowTracker.__init__, "__kwdefaults__",
                        {**MlflowTracker.__init__.__kwdefaults__, "max_retries": 1, "backoff_s": 0.05})
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(store)
    run_id = client.create_run(client.create_experiment("outage")).info.run_id
    dead = f"http://127.0.0.1:{free_port()}"
    summary = main(_stage(tiny, tmp_path / "scratch",
                          runtime=dict(tracking_uri=dead, tracking_run_id=run_id, sync_uri=str(tmp_path / "store"))))
    assert summary["tracking_pending_uri"] == str(tmp_path / "store" / "pending_metrics.jsonl")
    assert client.get_metric_history(run_id, "reward") == []
    shutil.rmtree(tmp_path / "scratch")  # the pod is gone
    assert replay_tracking(dead, [summary]) == 0  # still down: a warning, the file stays
    assert replay_tracking(store, [summary]) == replay_tracking(store, [summary]) > 0
    assert sorted(m.step for m in client.get_metric_history(run_id, "reward")) == [1, 2, 3, 4]
    assert client.get_run(run_id).data.params["optim.lr"] == "0.003"


# ---------------------------------------------------------------- 6. disk full

DISK_FULL = r"""
import json, os, resource, signal, sys
from pathlib import Path
import torch
from grpo_core.train import checkpoint
from grpo_core.io import storage
from grpo_core.model.loading import build_tiny, save_policy
root = Path(sys.argv[1])
torch.manual_seed(0)
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters())
model(torch.randn(2, 64)).sum().backward(); opt.step()
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
checkpoint.save(root / "checkpoints", 1, model, opt, sched, {"data_position": 1})
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
out = {}
def attempt(name, limit, fn):
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        fn(); out[name] = "no error"
    except Exception as exc:
        out[name] = f"{type(exc).__name__}: {exc}"
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))
save2 = lambda: checkpoint.save(root / "checkpoints", 2, model, opt, sched, {"data_position": 2})
attempt("weights", 1000, save2)          # model.safetensors hits the limit (safetensors error)
attempt("optimizer", 20000, save2)       # optimizer.pt hits it (torch.save's zip writer error)
tiny, tok = build_tiny("llama", 32, 1, 4)
attempt("final", 1000, lambda: save_policy(tiny, tok, root / "final"))
attempt("sync", 1000, lambda: storage.put_dir(root / "checkpoints" / "ckpt-000001", str(root / "synced")))
save2()                                  # space is back: the next save works
print(json.dumps(out))
"""


def test_disk_full_while_checkpointing_keeps_the_previous_checkpoint(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    res = subprocess.run([sys.executable, "-c", DISK_FULL, str(tmp_path)], env=env, capture_output=True,
                         text=True, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    for name in ("weights", "optimizer"):
        assert out[name].startswith("OSError: could not write checkpoint"), out[name]
        assert "File too large" in out[name] or "unexpected pos" in out[name], out[name]
        assert "previous checkpoint is intact" in out[name]
    assert "File too large" in out["final"] and "File too large" in out["sync"], out
    ckpts = tmp_path / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == ["ckpt-000001", "ckpt-000002"]  # no temp dirs
    assert checkpoint.verify(ckpts / "ckpt-000001") and checkpoint.verify(ckpts / "ckpt-000002")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]  # no .final.* / .synced.*


def test_checkpoints_and_saved_models_reach_the_disk_before_their_rename(tmp_path, monkeypatch):
    """Power loss is not reproducible here, so this checks the order of the system calls that make
    a rename durable: every file of the new directory (and the directory) is fsynced before it is
    renamed into place, and the parent directory after (so the new name itself survives)."""
    from grpo_core.model.loading import build_tiny, save_policy

    events, real_fsync, real_replace = [], os.fsync, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def replace(src, dst):
        real_replace(src, dst)
        events.append(("rename", str(src), str(dst)))

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    model, tok = build_tiny("llama", 32, 1, 2, seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0)
    written = [checkpoint.save(tmp_path / "ckpts", 1, model, opt, sched, {"iteration": 1}),
               save_policy(model, tok, tmp_path / "final")]
    for final in written:
        k, (_, tmp, _) = next((k, e) for k, e in enumerate(events) if e[0] == "rename" and e[2] == str(final))
        before = {e[1] for e in events[:k] if e[0] == "fsync"}
        names = [p.name for p in final.rglob("*")]
        assert names and {str(Path(tmp) / n) for n in names} | {tmp} <= before, (final, sorted(before))
        assert ("fsync", str(final.parent)) in events[k:], f"{final.parent} not fsynced after the rename"


# ---------------------------------------------------------------- 7. bad input


@pytest.mark.parametrize("override,match", [
    ({"compute": {"nproc_per_node": 2}, "curriculum": {"prompts_per_iter": 3}},
     r"curriculum\.prompts_per_iter: 3 prompts cannot be split across 2 ranks.*multiple of 2"),
    ({"gsm8k": {"gate": {"metric": "eval_accuracy"}, "validation": {"every": 0}}},
     r"stage 'gsm8k'\.gate\.metric.*set validation\.every"),
    ({"gsm8k": {"sampling": {"group_size": 1}}}, r"stage 'gsm8k'\.sampling\.group_size.*group_size >= 2"),
    ({"curriculum": {"loss": {"clip_low": -0.2}}}, r"stage 'curriculum'\.loss\.clip_low: must be >= 0"),
    ({"sft": {"hidden": "64"}}, r"config\.sft\.hidden = '64' has type str; expected <class 'int'>"),
    ({"compute": {"nproc_per_nodes": 2}},
     r"unknown field config\.compute\.nproc_per_nodes\. Did you mean 'nproc_per_node'"),
    ({"curriculm": {}}, r"Did you mean 'curriculum'"),
    ({"evaluate": {"gsm8k_size": -1}},
     r"register\.primary: 'gsm8k_test' is not evaluated \(the evaluated sets are \['arithmetic_test'\]\)"),
    ({"compute": {"nodes": 0}}, r"compute\.nodes: must be a whole number >= 1 \(1: one node, no gang\), got 0"),
    ({"compute": {"nodes": 1.5}}, r"config\.compute\.nodes = 1\.5 has type float"),
    ({"compute": {"nodes": 3, "nproc_per_node": 2}, "curriculum": {"prompts_per_iter": 8}},
     r"curriculum\.prompts_per_iter: 8 prompts cannot be split across 6 ranks \(compute\.nodes x "),
    ({"compute": {"nodes": 2}, "gsm8k": {"prompts_per_iter": 8, "execution": {"parallelism": "fsdp2"}}},
     r"gsm8k\.execution\.parallelism: 'fsdp2' writes every rank's checkpoint shards.*compute\.nodes = 2"),
    ({"compute": {"rdzv_port": 80}}, r"compute\.rdzv_port: must be a free TCP port in 1024\.\.65535.*got 80"),
])
def test_bad_pipeline_config_names_the_field_and_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        PipelineConfig.from_dict(override)


def test_bad_stage_config_writes_nothing(tiny, tmp_path):
    with pytest.raises(ConfigError, match="beta"):
        main(_stage(tiny, tmp_path / "out", loss=dict(beta=-0.1)))
    assert not (tmp_path / "out").exists()


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"}


@pytest.mark.parametrize("files,match", [
    (None, r"GSM8K directory .*/gsm8k does not exist; point GSM8K_DIR"),
    ({"test.jsonl": _jsonl(GOOD)}, r"has no train\.jsonl"),
    ({"train.jsonl": ""}, r"train\.jsonl is empty; it needs one JSON object per line"),
    ({"train.jsonl": _jsonl(GOOD, "{oops")}, r"train\.jsonl line 2 is not valid JSON"),
    ({"train.jsonl": _jsonl(GOOD, {"answer": "#### 4"})},
     r"train\.jsonl row 1 \(0-based\): needs non-empty string fields 'question' and 'answer'.*fix or drop"),
    ({"train.jsonl": _jsonl(GOOD, {"question": "q", "answer": "it is four"})},
     r"train\.jsonl row 1 \(0-based\): gold answer is not a number"),
])
def test_bad_gsm8k_files_name_the_file_and_row(tmp_path, files, match):
    from grpo_core.data.tasks.gsm8k import load

    d = tmp_path / "gsm8k"
    if files is not None:
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load(str(d), "train")


def test_bad_gsm8k_row_stops_a_stage_before_anything_is_written(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("GSM8K_DIR", raising=False)  # it would override gsm8k_source
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text(_jsonl(GOOD, GOOD, {"question": "q", "answer": "## none"}))
    with pytest.raises(ValueError, match=r"row 2 \(0-based\): gold answer is not a number"):
        main(_stage(tiny, tmp_path / "out", task="gsm8k", gsm8k_source=str(d)))
    assert not (tmp_path / "out").exists()


def test_wrong_length_reward_stops_before_any_update_or_checkpoint(tiny, tmp_path):
    with pytest.raises(ValueError,
                       match=r"'tests\.faulty_rewards:wrong_length' returned 15 values, expected a list of 16"):
        main(_stage(tiny, tmp_path, rewards=[{"fn": "tests.faulty_rewards:wrong_length"}]))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_hung_reward_function_stops_both_ranks_with_an_error_naming_it(tiny, tmp_path):
    """A verifier that never returns would stall every rank forever (the others wait in the next
    collective). Under torchrun, reward_timeout_s ends the stage with an error naming the function,
    before any update or checkpoint."""
    log = tmp_path / "torchrun.log"
    t0 = time.monotonic()
    rc = _finish(_torchrun(tiny, tmp_path / "out", log, rewards=[{"fn": "tests.faulty_rewards:hangs"}],
                           reward_timeout_s=2), log)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert "RewardTimeoutError: reward function 'tests.faulty_rewards:hangs' took more than 2 s" in text
    assert time.monotonic() - t0 < 300
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_a_rank_stuck_outside_collectives_fails_the_stage_after_collective_timeout_s(tiny, tmp_path):
    """Rank 1 hangs where no reward time limit applies (reward_timeout_s=0); rank 0 waits in the
    next collective for collective_timeout_s, not torch's 30 min (gloo) or 10 min (nccl), then
    fails with an error naming the field, and torchrun stops the stuck rank."""
    log = tmp_path / "torchrun.log"
    rc = _finish(_torchrun(tiny, tmp_path / "out", log, rewards=[{"fn": "tests.faulty_rewards:hangs_on_rank_1"}],
                           reward_timeout_s=0, execution={"collective_timeout_s": 5}, runtime={"stage": "cur"}), log)
    text = log.read_text()
    assert rc != 0, text[-3000:]
    assert ("CollectiveTimeoutError: rank 0 waited more than 5 s (stage 'cur'.execution.collective_timeout_s) "
            "for another rank in a collective") in text, text[-3000:]
    assert "raise stage 'cur'.execution.collective_timeout_s" in text
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_only_collective_timeouts_are_restated():
    from grpo_core.policy.dist import as_timeout_error

    gloo = RuntimeError("[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] "
                        "Timed out waiting 5000ms for recv operation to complete")
    assert "waited more than 5 s (x.collective_timeout_s)" in str(as_timeout_error(gloo, 5, "x.collective_timeout_s"))
    for other in (RuntimeError("CUDA out of memory"), TimeoutError("Timed out waiting for S3"), ValueError("x")):
        assert as_timeout_error(other, 5, "x") is None


def _tweak_tokenizer(d: Path, **fields) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **fields}))


def test_model_source_kinds_hub_ids_dirs_and_missing_paths(tiny, tmp_path, monkeypatch):
    """org/name is a hub id (the Kubernetes config's default), an existing dir is loaded from,
    anything path-like that does not exist is an error naming it."""
    from grpo_core.model.loading import _local_model_dir, load_policy

    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "openai-community/gpt2"):
        assert _local_model_dir(hub_id) == hub_id
    monkeypatch.chdir(tiny.parent)
    assert _local_model_dir(tiny.name) == tiny.name  # a relative dir that exists wins
    for missing in ("a/b/c", "./nope", str(tmp_path / "nope"), "~/no-such-model-dir"):
        with pytest.raises(FileNotFoundError, match=re.escape(repr(missing)) + " does not exist"):
            _local_model_dir(missing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id goes to the hub (offline here: a clear error)
    with pytest.raises(ValueError, match=r"could not load a tokenizer from 'no-such-org/no-such-model'"):
        load_policy("no-such-org/no-such-model")


def test_bad_model_dirs_are_errors_naming_the_dir_and_fix(tiny, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from grpo_core.model.loading import build_char_tokenizer, load_policy

    with pytest.raises(FileNotFoundError, match=r"model path '.*/missing' does not exist"):
        load_policy(str(tmp_path / "missing"))

    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, no_tok)
    with pytest.raises(ValueError, match=r"no-tokenizer' has no tokenizer files.*save_pretrained"):
        load_policy(str(no_tok))

    no_eos = tmp_path / "no-eos"
    shutil.copytree(tiny, no_eos)
    _tweak_tokenizer(no_eos, eos_token=None)
    with pytest.raises(ValueError, match=r"no-eos': tokenizer has no eos_token; set one"):
        load_policy(str(no_eos))

    new_pad = tmp_path / "new-pad"  # a pad token added to the tokenizer, not to the embeddings
    shutil.copytree(tiny, new_pad)
    tok = AutoTokenizer.from_pretrained(new_pad)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    tok.save_pretrained(new_pad)
    with pytest.raises(ValueError, match=r"new-pad': the tokenizer's pad token id \d+ is outside the model's "
                                         r"\d+ embeddings.*resize_token_embeddings"):
        load_policy(str(new_pad))

    no_pad = tmp_path / "no-pad"
    shutil.copytree(tiny, no_pad)
    _tweak_tokenizer(no_pad, pad_token=None)
    _, tok = load_policy(str(no_pad))
    assert tok.pad_token == tok.eos_token == "<eos>" and tok.padding_side == "left"

    bert = tmp_path / "bert"
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)
    BertForMaskedLM(cfg).save_pretrained(bert)
    build_char_tokenizer().save_pretrained(bert)
    with pytest.raises(ValueError, match=r"bert' is a 'bert' model .*encoder architecture.*decoder-only causal LM"):
        load_policy(str(bert))


def test_rewards_beyond_float32_are_an_error_not_a_silent_inf():
    """1e39 is finite in Python but inf in the trainer's float32 reward tensor."""
    from grpo_core.data.rewards import combine_rewards

    args = (["q", "q"], ["a", "b"], {})
    with pytest.raises(ValueError, match=r"weighted reward at index 1 is 1e\+39, outside the float32 range.*rescale"):
        combine_rewards([(lambda p, c, **_: [0.0, 1e39], 1.0, "huge")], *args)
    two = [(lambda p, c, **_: [2e38, 0.0], 1.0, "a"), (lambda p, c, **_: [2e38, 0.0], 1.0, "b")]
    with pytest.raises(ValueError, match="index 0 is 4e\\+38"):  # each term fits, the sum does not
        combine_rewards(two, *args)
    assert combine_rewards([(lambda p, c, **_: [1e38, 0.0], 1.0, "big")], *args)[0] == [1e38, 0.0]


def test_checkpoints_and_saved_models_unwrap_the_ddp_scorer_and_keep_the_optimizer_kind(tmp_path):
    """The trainer hands DDP a CompletionScorer: whatever layer is passed in, checkpoints and saved
    models hold the bare model's keys. A checkpoint written with one AdamW implementation resumes
    with the one this machine runs (the saved flag does not override it)."""
    from grpo_core.model.loading import build_tiny, save_policy, unwrap
    from grpo_core.policy.scoring import CompletionScorer

    model, tok = build_tiny("llama", 32, 1, 2, seed=0)
    wrapped = CompletionScorer(model)
    assert unwrap(wrapped) is model and unwrap(model) is model
    plain = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False)
    sched = torch.optim.lr_scheduler.LambdaLR(plain, lambda it: 1.0)
    path = checkpoint.save(tmp_path / "ckpts", 1, wrapped, plain, sched, {"iteration": 1})
    assert set(load_file(str(path / "model.safetensors"))) == set(model.state_dict())
    saved = save_policy(wrapped, tok, tmp_path / "final")
    assert set(load_file(str(saved / "model.safetensors"))) <= set(model.state_dict())
    fused = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    checkpoint.load(path, wrapped, fused, torch.optim.lr_scheduler.LambdaLR(fused, lambda it: 1.0))
    assert fused.param_groups[0]["fused"] is True


def test_sampling_from_a_diverged_policy_is_an_error_not_a_token():
    from grpo_core.rollout.decode import sample_inverse_cdf

    for row in ([float("nan"), 0.5, 0.5], [1.0, float("inf"), 0.0], [0.0, 0.0, 0.0]):
        with pytest.raises(ValueError, match="row 1 .*not a distribution.*NaN/inf"):
            sample_inverse_cdf(torch.tensor([[0.2, 0.3, 0.5], row]))


def test_collectives_run_where_the_backend_reduces():
    """nccl reduces CUDA tensors only: helpers called without a device (the non-finite check, the
    dynamic-sampling refill vote) must not build a CPU tensor there. Without a process group or
    on gloo that is the CPU; a device passed in wins."""
    from grpo_core.policy.dist import collective_device

    assert collective_device() == torch.device("cpu")
    assert collective_device("meta") == torch.device("meta")
