"""Checkpoints under damage, for real: a SIGKILLed torchrun writer, torn and truncated checkpoints,
pruning around damaged ones, a full disk (RLIMIT_FSIZE), fsync before rename, and what a
checkpoint holds (the bare model's keys, this machine's AdamW). Nothing is lost; the resume is
exact. docs/reliability.md maps every fault to its test.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest
import torch
from safetensors.torch import load_file

from grpo_core.train import checkpoint
from grpo_core.train.entry import main
from tests.fault_helpers import (
    finish_torchrun,
    logged_iterations,
    short_stage,
    small_state,
    start_torchrun,
    torchrun_worker,
    wait_for_iteration,
)
from tests.helpers import REPO, same_weights


def test_sigkill_of_a_torchrun_worker_then_rerun_resumes_bitwise(tiny, tmp_path):
    """SIGKILL rank 0 (the checkpoint writer) mid-run: torchrun fails, the latest checkpoint
    verifies, the same command resumes, and the weights equal an uninterrupted run's."""
    kw = dict(iterations=8, checkpoint=dict(every=2, keep=2))
    killed, straight = tmp_path / "killed", tmp_path / "straight"
    log = tmp_path / "killed.log"
    proc = start_torchrun(tiny, killed, log, **kw)
    wait_for_iteration(proc, killed, log, 3)
    victim = torchrun_worker(proc.pid, rank=0)
    workers = [c.pid for c in psutil.Process(proc.pid).children(recursive=True)]
    os.kill(victim.pid, signal.SIGKILL)
    assert finish_torchrun(proc, log) != 0
    assert not (killed / "final").exists() and not (killed / "summary.json").exists(), "kill came too late"
    assert not [p for p in workers if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"], \
        "a worker outlived torchrun"
    last = checkpoint.latest_local(killed / "checkpoints")
    assert last is not None and checkpoint.verify(last) and checkpoint.iteration_of(last.name) >= 2
    resumed_at = checkpoint.iteration_of(last.name)

    rerun = start_torchrun(tiny, killed, log, **kw)
    straight_proc = start_torchrun(tiny, straight, tmp_path / "straight.log", **kw)
    assert finish_torchrun(rerun, log) == 0, log.read_text()[-3000:]
    assert finish_torchrun(straight_proc, tmp_path / "straight.log") == 0, \
        (tmp_path / "straight.log").read_text()[-3000:]
    summary = json.loads((killed / "summary.json").read_text())
    assert summary["resumed_from_iteration"] == resumed_at and summary["iterations_run"] == 8
    assert logged_iterations(killed) == list(range(1, 9))  # iterations after the checkpoint logged once
    assert same_weights(killed / "final", straight / "final")
    assert not list((killed / "checkpoints").glob(".ckpt-*")), "a temp dir survived the next save"


def test_torn_writes_leave_the_last_good_checkpoint_and_prune_cleans_up(tmp_path):
    """What a kill during a checkpoint write can leave: a hidden temp dir, a checkpoint with a
    missing file, a manifest cut short, a manifest of the wrong shape, an empty manifest."""
    root = tmp_path / "checkpoints"
    model, opt, sched = small_state()
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
    assert checkpoint.load(found, *small_state(seed=1))["iteration"] == 4

    checkpoint.prune(root, keep=2)  # damaged ones do not count towards keep
    assert sorted(p.name for p in root.iterdir()) == ["ckpt-000002", "ckpt-000004"]


def test_pruning_after_a_save_keeps_it_whatever_newer_leftovers_look_like(tmp_path):
    """ckpt-6 was just written (a resume after ckpt-8 failed its checksum): ckpt-8, complete in
    size but corrupt, must neither evict ckpt-6 nor be deleted here; older ones go past keep."""
    root = tmp_path / "checkpoints"
    model, opt, sched = small_state()
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


def test_resume_skips_a_truncated_checkpoint_and_still_matches(tiny, tmp_path):
    main(short_stage(tiny, tmp_path, checkpoint=dict(keep=3)))
    reference = tmp_path / "reference"
    shutil.copytree(tmp_path / "final", reference)
    model_file = tmp_path / "checkpoints" / "ckpt-000004" / "model.safetensors"
    model_file.write_bytes(model_file.read_bytes()[:-64])  # truncated

    with pytest.warns(UserWarning, match="ckpt-000004 is incomplete or corrupt"):
        summary = main(short_stage(tiny, tmp_path, checkpoint=dict(keep=3)))
    assert summary["resumed_from_iteration"] == 2 and summary["iterations_run"] == 4
    assert logged_iterations(tmp_path) == [1, 2, 3, 4]
    assert same_weights(reference, tmp_path / "final")  # redoing 3..4 from ckpt-2 is exact
    assert checkpoint.verify(tmp_path / "checkpoints" / "ckpt-000004")  # rewritten whole


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
