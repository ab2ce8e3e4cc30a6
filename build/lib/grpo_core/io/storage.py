"""Where checkpoints and models live: a local directory or an ``s3://`` prefix.

Only this module talks to S3 (boto3, imported lazily). Everything above it speaks in URIs:
``put_dir(local, uri)``, ``get_dir(uri, local)``, ``list_dirs(uri)``, ``read_text(uri)``.
Local writes are atomic (write to a temporary sibling, then ``os.replace``), so a crash leaves
either the old or the new content, never half of one. S3 uploads are verified by size before a
caller may treat them as complete, and transient errors are retried by botocore's standard
retry mode. The S3 endpoint comes from ``GRPO_S3_ENDPOINT_URL``, else ``AWS_ENDPOINT_URL``,
else ``METAFLOW_S3_ENDPOINT_URL`` (so one emulator serves Metaflow and us), else AWS.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

S3_MAX_ATTEMPTS = 8  # botocore "standard" retry mode: exponential backoff on throttling/5xx/network


def is_s3(uri: str) -> bool:
    return str(uri).startswith("s3://")


def join(root: str, *parts: str) -> str:
    """Join URI parts with '/', keeping ``s3://`` intact."""
    out = str(root).rstrip("/")
    for p in parts:
        out += "/" + str(p).strip("/")
    return out


def split_s3(uri: str) -> tuple[str, str]:
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"S3 URI {uri!r} has no bucket; use s3://BUCKET/PREFIX")
    return bucket, key.strip("/")


def s3_client():
    import boto3
    from botocore.config import Config

    endpoint = (os.environ.get("GRPO_S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")
                or os.environ.get("METAFLOW_S3_ENDPOINT_URL"))
    cfg = Config(retries={"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"})
    return boto3.client("s3", endpoint_url=endpoint or None, config=cfg)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def atomic_write_text(path: str | Path, text: str) -> None:
    """Write a file so that readers see the old or the new content, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fsync_tree(root: str | Path) -> None:
    """Flush every file under the directory ``root``, then the directories, to the disk.

    A rename is atomic but not durable by itself: after a power loss or kernel crash the new name
    can point at files whose data never reached the disk (short or empty files). Called on a
    finished temporary directory before it is renamed into place (the rename itself is made
    durable by ``fsync_dir`` on the parent)."""
    entries = [Path(root), *Path(root).rglob("*")]
    for f in (e for e in entries if e.is_file()):
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    for d in (e for e in entries if e.is_dir()):
        fsync_dir(d)


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a rename into it) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_dir(dest: str | Path, fill) -> Path:
    """Build a directory with ``fill(tmp_dir)`` beside ``dest``, then swap it into place.

    Readers see the old or the new directory, never a half-written one (when ``dest`` existed,
    there is an instant between the two renames in which it is absent: POSIX has no atomic swap
    of directories; a crash there leaves the new one complete beside it, ``.<name>.<random>``);
    if ``fill`` fails (a full disk), the old directory stays and no temporary directory is left.
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        fill(tmp)
        fsync_tree(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if dest.exists():
        old = dest.with_name(f".{dest.name}.old.{os.getpid()}")
        os.replace(dest, old)
        os.replace(tmp, dest)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, dest)
    fsync_dir(dest.parent)
    return dest


def _s3_error(exc: Exception, bucket: str, key: str) -> RuntimeError:
    return RuntimeError(f"S3 request failed for s3://{bucket}/{key}: {exc}. Check the bucket exists, "
                        "the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY) and the endpoint "
                        "(GRPO_S3_ENDPOINT_URL / AWS_ENDPOINT_URL).")


def put_dir(local_dir: str | Path, uri: str) -> str:
    """Copy a directory tree to ``uri`` (replacing what was there) and return ``uri``.

    On S3 every file is uploaded (a ``manifest.json`` last) and then the objects under ``uri``
    that the tree does not hold are deleted: a model saved again with another layout (sharded
    after single-file, or the reverse) must not be read back mixed with the old files."""
    local_dir = Path(local_dir)
    if not is_s3(uri):
        if Path(uri).resolve() != local_dir.resolve():
            replace_dir(uri, lambda tmp: shutil.copytree(local_dir, tmp, dirs_exist_ok=True))
        return uri
    bucket, prefix = split_s3(uri)
    if not prefix:
        raise ValueError(f"put_dir to {uri!r} would replace the whole bucket; use s3://BUCKET/PREFIX")
    client = s3_client()
    files = sorted((p for p in local_dir.rglob("*") if p.is_file()), key=lambda p: (p.name == "manifest.json", str(p)))
    keys = {path: f"{prefix}/{path.relative_to(local_dir).as_posix()}" for path in files}
    for path, key in keys.items():  # a manifest goes last: its presence marks the upload complete
        try:
            client.upload_file(str(path), bucket, key)
            size = client.head_object(Bucket=bucket, Key=key)["ContentLength"]
        except Exception as exc:  # botocore raises many types; name the object either way
            raise _s3_error(exc, bucket, key) from exc
        if size != path.stat().st_size:
            raise RuntimeError(f"upload of s3://{bucket}/{key} is incomplete: {size} of "
                               f"{path.stat().st_size} bytes; the checkpoint does not count")
    kept = set(keys.values())
    _delete_keys(client, bucket, [k for k in _list_keys(client, bucket, prefix + "/") if k not in kept])
    return uri


def _delete_keys(client, bucket: str, keys: list[str]) -> None:
    for i in range(0, len(keys), 1000):  # delete_objects takes at most 1000 keys
        try:
            errors = client.delete_objects(Bucket=bucket, Delete={
                "Objects": [{"Key": k} for k in keys[i:i + 1000]]}).get("Errors", [])
        except Exception as exc:
            raise _s3_error(exc, bucket, keys[i]) from exc
        if errors:  # per-key failures come back in a 200 response, not as an exception
            e = errors[0]
            raise _s3_error(RuntimeError(f"{e.get('Code')}: {e.get('Message')} ({len(errors)} objects)"),
                            bucket, e.get("Key", keys[i]))


def delete_dir(uri: str) -> None:
    """Delete a local directory tree or everything under an S3 prefix (never a whole bucket)."""
    if not is_s3(uri):
        shutil.rmtree(uri, ignore_errors=True)
        return
    bucket, prefix = split_s3(uri)
    if not prefix:
        raise ValueError(f"delete_dir of {uri!r} would empty the whole bucket; use s3://BUCKET/PREFIX")
    client = s3_client()
    _delete_keys(client, bucket, list(_list_keys(client, bucket, prefix + "/")))


def get_dir(uri: str, local_dir: str | Path) -> Path:
    """Materialise ``uri`` as a local directory (a no-op for local paths) and return it."""
    if not is_s3(uri):
        if not Path(uri).is_dir():
            raise FileNotFoundError(f"{uri} is not a directory")
        return Path(uri)
    bucket, prefix = split_s3(uri)
    client = s3_client()
    local_dir = Path(local_dir)
    found = False
    for key in _list_keys(client, bucket, prefix + "/"):
        if key.endswith("/"):  # a folder marker (consoles and some tools create them): no file
            continue
        found = True
        dest = local_dir / key[len(prefix) + 1:]
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            client.download_file(bucket, key, str(dest))
        except Exception as exc:
            raise _s3_error(exc, bucket, key) from exc
    if not found:
        raise FileNotFoundError(f"nothing stored under {uri}")
    return local_dir


def _list_objects(client, bucket: str, prefix: str):
    try:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            yield from page.get("Contents", [])
    except Exception as exc:
        raise _s3_error(exc, bucket, prefix) from exc


def _list_keys(client, bucket: str, prefix: str):
    for obj in _list_objects(client, bucket, prefix):
        yield obj["Key"]


def s3_file_sizes(uri: str) -> dict[str, int]:
    """Size of every object under an S3 prefix, by its path relative to the prefix (one listing)."""
    bucket, prefix = split_s3(uri)
    return {o["Key"][len(prefix) + 1:]: o["Size"] for o in _list_objects(s3_client(), bucket, prefix + "/")}


def list_dirs(uri: str) -> list[str]:
    """Names of the immediate sub-directories of ``uri`` (empty if it does not exist)."""
    if not is_s3(uri):
        p = Path(uri)
        return sorted(c.name for c in p.iterdir() if c.is_dir()) if p.is_dir() else []
    bucket, prefix = split_s3(uri)
    names = set()
    for key in _list_keys(s3_client(), bucket, prefix + "/"):
        rest = key[len(prefix) + 1:]
        if "/" in rest:
            names.add(rest.split("/", 1)[0])
    return sorted(names)


def write_text(uri: str, text: str) -> str:
    """Write one small file to a local path (atomically) or an S3 key; returns ``uri``."""
    if not is_s3(uri):
        atomic_write_text(uri, text)
        return uri
    bucket, key = split_s3(uri)
    try:
        s3_client().put_object(Bucket=bucket, Key=key, Body=text.encode())
    except Exception as exc:
        raise _s3_error(exc, bucket, key) from exc
    return uri


def read_text(uri: str) -> str | None:
    """Contents of one file, or None if it does not exist."""
    if not is_s3(uri):
        p = Path(uri)
        return p.read_text() if p.is_file() else None
    bucket, key = split_s3(uri)
    client = s3_client()
    try:
        return client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    except client.exceptions.NoSuchKey:
        return None
    except Exception as exc:
        raise _s3_error(exc, bucket, key) from exc
