"""Checkpoints on S3 against a real moto server on 127.0.0.1 (the ``moto`` fixture, whose request
log shows the order of uploads): errors name the URI, the manifest goes last, damaged copies are
skipped and pruned like local ones, another node reads rank 0's choice, connection resets (a real
resetting proxy) are retried.
"""
from __future__ import annotations

import time

import pytest
import torch

from grpo_core.io import storage
from grpo_core.train import checkpoint
from tests.fault_helpers import small_state
from tests.s3_helpers import DroppingProxy, put_checkpoint


def test_s3_missing_bucket_and_missing_prefix_name_the_uri(s3, tmp_path):
    local = checkpoint.save(tmp_path, 1, *small_state(), {})
    with pytest.raises(RuntimeError, match=r"s3://no-such-bucket/run/ckpt-000001/model\.safetensors.*bucket exists"):
        storage.put_dir(local, "s3://no-such-bucket/run/ckpt-000001")
    with pytest.raises(FileNotFoundError, match="s3://ckpts/nothing/here"):
        storage.get_dir("s3://ckpts/nothing/here", tmp_path / "dl")
    assert storage.list_dirs("s3://ckpts/nothing") == []


def test_s3_checkpoint_sync_writes_manifest_last_and_resumes(s3, moto, tmp_path):
    root = "s3://ckpts/sync-order/checkpoints"
    put_checkpoint(tmp_path, root, 2)
    time.sleep(0.3)  # let the server's request log catch up
    puts = [ln.split('"PUT /ckpts/sync-order/checkpoints/ckpt-000002/')[1].split(" ")[0]
            for ln in moto.log.read_text().splitlines() if '"PUT /ckpts/sync-order/' in ln]
    assert sorted(puts) == sorted(checkpoint.REQUIRED | checkpoint.WEIGHTS | {"manifest.json"}), puts
    assert puts[-1] == "manifest.json", puts
    found = checkpoint.latest([root], tmp_path / "scratch")
    assert found is not None and checkpoint.verify(found)
    assert checkpoint.load(found, *small_state(seed=9))["iteration"] == 2


def test_a_rank_on_another_node_fetches_rank_0s_checkpoint_from_storage(s3, tmp_path):
    """Multi-node resume: rank 0 broadcasts the path of the checkpoint it chose on its own disk;
    a rank that cannot see that path loads the same checkpoint from the stage's storage."""
    from types import SimpleNamespace

    from grpo_core.policy.dist import DistInfo
    from grpo_core.train.stage_checkpoints import StageCheckpoints

    stage = "s3://ckpts/other-node"
    put_checkpoint(tmp_path, storage.join(stage, "checkpoints"), 2)
    put_checkpoint(tmp_path, storage.join(stage, "checkpoints"), 4)
    cfg = SimpleNamespace(runtime=SimpleNamespace(resume_from=["s3://ckpts/absent-run", stage]))
    node1 = StageCheckpoints(cfg, DistInfo(3, 4, 1, torch.device("cpu")), tmp_path / "node-1")
    chosen_on_node0 = tmp_path / "node-0-disk" / "scratch" / "0123abcd-ckpt-000002"  # not here
    got = node1.readable(chosen_on_node0)
    assert got.name.endswith("ckpt-000002") and "rank-3" in str(got) and checkpoint.verify(got)
    assert checkpoint.load(got, *small_state(seed=9))["data_position"] == 2  # the one chosen, not the newest
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
        put_checkpoint(tmp_path, root, it)
    s3.delete_object(Bucket="ckpts", Key="damaged/checkpoints/ckpt-000006/manifest.json")  # died before the manifest
    s3.delete_object(Bucket="ckpts", Key="damaged/checkpoints/ckpt-000004/optimizer.pt")   # lost an object
    with pytest.warns(UserWarning) as caught:
        found = checkpoint.latest([str(tmp_path / "no-local"), root], tmp_path / "scratch")
    msgs = [str(w.message) for w in caught]
    assert any("damaged/checkpoints/ckpt-000006 is incomplete" in m for m in msgs)
    assert any("damaged/checkpoints/ckpt-000004 is incomplete" in m for m in msgs)
    assert checkpoint.load(found, *small_state(seed=9))["iteration"] == 2
    assert [p.name for p in (tmp_path / "scratch").iterdir()] == [found.name]  # bad downloads removed


def test_s3_folder_markers_are_not_files(s3, tmp_path):
    """A console-made ``prefix/`` marker under a model: downloaded as nothing, not a failure."""
    local = checkpoint.save(tmp_path, 1, *small_state(), {})
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
        put_checkpoint(tmp_path, root, it)
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
        put_checkpoint(tmp_path, "s3://ckpts/flaky/checkpoints", 2)
        found = checkpoint.latest(["s3://ckpts/flaky/checkpoints"], tmp_path / "scratch")
    finally:
        proxy.close()
    assert proxy.dropped == 2 and checkpoint.verify(found)
