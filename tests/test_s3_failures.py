"""S3 failure paths against a real moto server on 127.0.0.1: each ends with nothing lost (the
previous checkpoint intact and found) and an error naming the object.

Faults moto cannot produce by itself (a file that grows while it is uploaded, a per-key error in
a 200 ``DeleteObjects`` answer, a connection lost in the middle of a download) are injected at
botocore's event hooks of the real client, so every request still reaches the real server.
"""
from __future__ import annotations

import pytest
from botocore.exceptions import EndpointConnectionError

from grpo_core.io import storage
from grpo_core.train import checkpoint
from tests.fault_helpers import small_state
from tests.s3_helpers import DroppingProxy, put_checkpoint

ROOT = "s3://ckpts/failures"


def _hooked_client(monkeypatch, event: str, handler):
    """storage's S3 client, real, with ``handler`` on botocore ``event``."""
    real = storage.s3_client

    def client():
        c = real()
        c.meta.events.register(event, handler)
        return c

    monkeypatch.setattr(storage, "s3_client", client)


def _latest_is(root: str, iteration: int, scratch) -> None:
    found = checkpoint.latest([root], scratch)
    assert found is not None and checkpoint.verify(found)
    assert checkpoint.load(found, *small_state(seed=9))["iteration"] == iteration


def test_an_upload_whose_size_check_fails_does_not_count(s3, tmp_path, monkeypatch):
    """A weights file that grows after its upload (still being written): the size check stops
    put_dir before the manifest, so ckpt 4 never counts and resume takes ckpt 2."""
    root = f"{ROOT}/size/checkpoints"
    put_checkpoint(tmp_path / "a", root, 2)
    local = checkpoint.save(tmp_path / "b", 4, *small_state(seed=4), {"data_position": 4})

    def grow(params, **_):
        if params["Key"].endswith("model.safetensors"):
            with open(local / "model.safetensors", "ab") as f:
                f.write(b"\0" * 7)

    with monkeypatch.context() as m, pytest.raises(
            RuntimeError, match=r"upload of s3://ckpts/failures/size/checkpoints/ckpt-000004/"
                                r"model\.safetensors is incomplete: \d+ of \d+ bytes"):
        _hooked_client(m, "before-parameter-build.s3.HeadObject", lambda params, **kw: grow(params))
        storage.put_dir(local, storage.join(root, local.name))
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix="failures/size/")["Contents"]]
    assert "failures/size/checkpoints/ckpt-000004/manifest.json" not in keys
    with pytest.warns(UserWarning, match="ckpt-000004 is incomplete"):
        _latest_is(root, 2, tmp_path / "scratch")


def test_per_key_delete_errors_name_the_key_and_keep_the_new_upload(s3, tmp_path, monkeypatch):
    """put_dir over an old layout: S3 refuses to delete one leftover (a per-key error in a 200
    answer); put_dir fails naming it, after the new files are all uploaded."""
    first, second = tmp_path / "first", tmp_path / "second"
    for d, names in ((first, ("model.safetensors", "old.txt")), (second, ("model.safetensors", "config.json"))):
        d.mkdir()
        for n in names:
            (d / n).write_text(f"{d.name}:{n}")
    uri = f"{ROOT}/delete/final"
    storage.put_dir(first, uri)

    def refuse(parsed, **_):
        parsed["Deleted"] = [d for d in parsed.get("Deleted", []) if not d["Key"].endswith("old.txt")]
        parsed["Errors"] = [{"Key": "failures/delete/final/old.txt", "Code": "AccessDenied",
                             "Message": "Access Denied"}]

    with monkeypatch.context() as m, pytest.raises(
            RuntimeError, match=r"s3://ckpts/failures/delete/final/old\.txt: AccessDenied"):
        _hooked_client(m, "after-call.s3.DeleteObjects", refuse)
        storage.put_dir(second, uri)
    got = storage.get_dir(uri, tmp_path / "dl")
    assert (got / "model.safetensors").read_text() == "second:model.safetensors"
    assert (got / "config.json").read_text() == "second:config.json"


def test_a_download_failing_half_way_names_the_key_and_loses_no_checkpoint(s3, tmp_path, monkeypatch):
    """The connection drops after some files of ckpt 4 arrived: the resume stops naming the object
    (it does not fall back to ckpt 2 on a network fault); with the network back it takes ckpt 4."""
    root = f"{ROOT}/download/checkpoints"
    put_checkpoint(tmp_path / "a", root, 2)
    put_checkpoint(tmp_path / "b", root, 4)
    fetched = []

    def drop_on_the_optimizer(params, **_):
        fetched.append(params["Key"])
        if params["Key"].endswith("ckpt-000004/optimizer.pt"):
            raise EndpointConnectionError(endpoint_url=str(params["Key"]))

    with monkeypatch.context() as m, pytest.raises(
            RuntimeError, match=r"s3://ckpts/failures/download/checkpoints/ckpt-000004/optimizer\.pt"):
        _hooked_client(m, "before-parameter-build.s3.GetObject", drop_on_the_optimizer)
        checkpoint.latest([root], tmp_path / "scratch")
    assert len(fetched) > 1, "half-way: other files of the checkpoint were fetched first"
    _latest_is(root, 4, tmp_path / "scratch")
    assert checkpoint.stored_complete(storage.join(root, "ckpt-000002"))


def test_retries_running_out_name_the_key_and_leave_the_stored_checkpoint(s3, moto, tmp_path,
                                                                          monkeypatch):
    """Every connection reset: the upload gives up after S3_MAX_ATTEMPTS tries, naming the first
    object; ckpt 2, written before, is intact and is what a resume finds."""
    root = f"{ROOT}/retries/checkpoints"
    put_checkpoint(tmp_path / "a", root, 2)
    monkeypatch.setattr(storage, "S3_MAX_ATTEMPTS", 3)  # the backoff of 8 tries would take ~a minute
    proxy = DroppingProxy(moto.port, drop=10**6)
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", proxy.url)
    local = checkpoint.save(tmp_path / "b", 4, *small_state(seed=4), {"data_position": 4})
    try:
        with pytest.raises(RuntimeError, match=r"S3 request failed for s3://ckpts/failures/retries/checkpoints/"
                                               r"ckpt-000004/\S+: .*endpoint"):
            storage.put_dir(local, storage.join(root, local.name))
    finally:
        proxy.close()
    assert 3 <= proxy.dropped <= 6, proxy.dropped  # it gave up: a few tries of each layer, not endless
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", moto.url)
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket="ckpts", Prefix="failures/retries/")["Contents"]]
    assert not any("ckpt-000004" in k for k in keys)
    _latest_is(root, 2, tmp_path / "scratch")


def test_read_text_names_the_key_for_errors_other_than_a_missing_key(s3, moto, tmp_path, monkeypatch):
    storage.write_text(f"{ROOT}/read/pending_metrics.jsonl", '{"iteration": 1}\n')
    assert storage.read_text(f"{ROOT}/read/absent.jsonl") is None  # a missing key: nothing to read
    with pytest.raises(RuntimeError, match=r"s3://no-such-bucket/run/pending_metrics\.jsonl: .*NoSuchBucket"):
        storage.read_text("s3://no-such-bucket/run/pending_metrics.jsonl")
    monkeypatch.setattr(storage, "S3_MAX_ATTEMPTS", 2)
    proxy = DroppingProxy(moto.port, drop=10**6)
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", proxy.url)
    try:
        with pytest.raises(RuntimeError, match=r"s3://ckpts/failures/read/pending_metrics\.jsonl: "):
            storage.read_text(f"{ROOT}/read/pending_metrics.jsonl")
    finally:
        proxy.close()
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", moto.url)
    assert storage.read_text(f"{ROOT}/read/pending_metrics.jsonl") == '{"iteration": 1}\n'  # not lost
