"""Training checkpoints: complete or absent, verified by checksum, found again after a crash.

A checkpoint is a directory ``ckpt-<iteration:06d>/`` holding the model weights (safetensors)
and optimizer state (for a sharded policy instead: every rank's shards of both, written by
``torch.distributed.checkpoint`` as ``.metadata`` plus ``__<rank>_0.distcp``), scheduler state,
RNG states and ``state.json`` (iteration, data position, counters), plus ``manifest.json`` with
the size and sha256 of every file. It is written into a
hidden temporary directory, flushed to disk (fsync) and renamed into place only after the
manifest is written, so a crash, a power loss or a full disk leaves the previous checkpoint
intact. Loading verifies every checksum; a corrupt or truncated checkpoint is skipped with a
warning and the previous one is used.
Everything loads with ``weights_only=True`` (no pickle code execution).
"""
from __future__ import annotations

import hashlib
import json
import pickle
import random
import shutil
import warnings
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from grpo_core.io import storage
from grpo_core.model.loading import unwrap

PREFIX = "ckpt-"
MANIFEST = "manifest.json"
REQUIRED = frozenset({"scheduler.pt", "rng.pt", "state.json"})
WEIGHTS = frozenset({"model.safetensors", "optimizer.pt"})  # one process's weights and AdamW state, or
SHARDED = ".metadata"  # the index of torch.distributed.checkpoint's per-rank shards (parallelism fsdp2)


def has_required(names) -> bool:
    """A manifest's names hold a whole checkpoint: the common files and the weights, either kind."""
    names = set(names)
    return REQUIRED <= names and (WEIGHTS <= names or SHARDED in names)


def name_for(iteration: int) -> str:
    return f"{PREFIX}{iteration:06d}"


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": list(_listify(random.getstate()))}


def _listify(x):
    return [_listify(v) for v in x] if isinstance(x, tuple) else x


def _tuplify(x):
    return tuple(_tuplify(v) for v in x) if isinstance(x, list) else x


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_tuplify(state["python"]))


def save(ckpt_root: str | Path, iteration: int, model, optimizer, scheduler, state: dict,
         extra_files: dict[str, Path] | None = None, write_shards=None) -> Path:
    """Write ``ckpt-<iteration>`` atomically under ``ckpt_root`` and return its path.
    ``extra_files`` (name -> existing file) are copied in and covered by the manifest.
    ``write_shards(tmp_dir)``, if given, writes the weights and optimizer state instead (the
    sharded policy's ranks, all into the directory being filled)."""
    final = Path(ckpt_root) / name_for(iteration)
    module = unwrap(model)

    def fill(tmp: Path) -> None:
        if write_shards is not None:
            write_shards(tmp)
        else:
            weights = {k: v.detach().contiguous().cpu() for k, v in trained_weights(module).items()}
            _save_weights(weights, tmp / "model.safetensors")
            torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng_state(), tmp / "rng.pt")
        (tmp / "state.json").write_text(json.dumps({**state, "iteration": iteration}, indent=1))
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
        manifest = {p.name: {"size": p.stat().st_size, "sha256": storage.sha256_file(p)}
                    for p in sorted(tmp.iterdir())}
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))

    try:
        return storage.replace_dir(final, fill)  # temp dir, fsync, rename: old or new, never torn
    except BaseException as exc:
        # A full disk surfaces as OSError (ENOSPC/EFBIG) from Python, RuntimeError from
        # torch.save's zip writer and SafetensorError from safetensors: report all three alike.
        if isinstance(exc, (OSError, RuntimeError)) or type(exc).__name__ == "SafetensorError":
            raise OSError(f"could not write checkpoint {final} ({type(exc).__name__}: {exc}); the previous "
                          "checkpoint is intact. Free disk space or point output_dir elsewhere, "
                          "then resume.") from exc
        raise


def trained_weights(module) -> dict:
    """What training changes: the whole state dict, or, when some parameters are frozen (LoRA),
    only the trained ones (the adapters)."""
    params = dict(module.named_parameters())
    if all(p.requires_grad for p in params.values()):
        return module.state_dict()
    return {k: p for k, p in params.items() if p.requires_grad}


def _load_weights(module, path: Path) -> None:
    """Load a ``trained_weights`` file; every trained parameter must be in it and nothing else."""
    missing, unexpected = module.load_state_dict(load_file(str(path)), strict=False)
    trained = {k for k, p in module.named_parameters() if p.requires_grad}
    absent = sorted(set(missing) & trained)
    if absent or unexpected:
        raise ValueError(f"checkpoint weights {path} do not fit this model (missing {absent[:3]}, unexpected "
                         f"{sorted(unexpected)[:3]}): it was written with other lora settings or another "
                         "model. Resume with the settings it was written with, or start a new run.")


def _save_weights(weights: dict, path: Path) -> None:
    # Tied weights (embeddings == lm_head) share storage; safetensors refuses shared tensors.
    seen, out = {}, {}
    for k, v in weights.items():
        key = (v.data_ptr(), v.shape)
        out[k] = v.clone() if key in seen else v
        seen[key] = k
    save_file(out, str(path))


def verify(path: str | Path) -> bool:
    """True when the manifest exists and every file matches its size and sha256."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        if not isinstance(manifest, dict) or not has_required(manifest):
            return False
        for name, meta in manifest.items():
            f = path / name
            if not f.is_file() or f.stat().st_size != meta["size"] or storage.sha256_file(f) != meta["sha256"]:
                return False
    except (OSError, ValueError, KeyError, TypeError):  # unreadable, or a manifest of the wrong shape
        return False
    return True


def iteration_of(name: str) -> int:
    return int(name[len(PREFIX):])


def latest_local(ckpt_root: str | Path) -> Path | None:
    """The newest verified checkpoint under a local directory (corrupt ones are skipped)."""
    root = Path(ckpt_root)
    names = sorted((n for n in storage.list_dirs(str(root)) if n.startswith(PREFIX)), reverse=True)
    for name in names:
        if verify(root / name):
            return root / name
        warnings.warn(f"checkpoint {root / name} failed its checksum check; using an older one")
    return None


def latest(locations: list[str], scratch: str | Path) -> Path | None:
    """The newest verified checkpoint across storage locations (dirs or s3:// prefixes)."""
    candidates = []
    for loc in locations:
        for name in storage.list_dirs(loc):
            if name.startswith(PREFIX):
                candidates.append((iteration_of(name), loc, name))
    for it, loc, name in sorted(candidates, reverse=True):
        found = fetch(loc, name, scratch)
        if found:
            return found
        warnings.warn(f"checkpoint {storage.join(loc, name)} is incomplete or corrupt "
                      "(checksum mismatch); falling back to an older one")
    return None


def fetch(loc: str, name: str, scratch: str | Path) -> Path | None:
    """Checkpoint ``name`` under ``loc`` as a verified local dir (an s3:// one is downloaded into
    ``scratch``), or None when it is absent, incomplete or corrupt there."""
    if not storage.is_s3(loc):
        return Path(loc) / name if verify(Path(loc) / name) else None
    # A fresh download dir per candidate: stale files from an earlier attempt must not count.
    local = Path(scratch) / f"{hashlib.sha1(loc.encode()).hexdigest()[:12]}-{name}"
    shutil.rmtree(local, ignore_errors=True)
    try:
        storage.get_dir(storage.join(loc, name), local)
    except FileNotFoundError:
        return None
    if verify(local):
        return local
    shutil.rmtree(local, ignore_errors=True)
    return None


def name_of(path: str | Path) -> str:
    """The checkpoint name (``ckpt-<iteration>``) of a local copy: the checkpoint dir itself, or a
    ``fetch`` download dir, whose name prefixes the source's hash."""
    name = Path(path).name
    return name[name.index(PREFIX):]


def load(path: str | Path, model, optimizer, scheduler, read_shards=None) -> dict:
    """Restore model/optimizer/scheduler/RNG from a verified checkpoint; returns state.json.
    ``read_shards(path)`` loads a sharded checkpoint's weights and optimizer state (given exactly
    when the live policy is sharded: the two kinds do not load into each other)."""
    path = Path(path)
    sharded = (path / SHARDED).is_file()
    if sharded != (read_shards is not None):
        written, now = ("fsdp2", "ddp") if sharded else ("ddp", "fsdp2")
        raise ValueError(f"checkpoint {path} was written with parallelism = '{written}', but this stage runs "
                         f"'{now}'. Resume with parallelism = '{written}' (fsdp2: on the same number of ranks), "
                         "or start a new run.")
    if sharded:
        read_shards(path)
    else:
        _load_weights(unwrap(model), path / "model.safetensors")
        saved = _load_tensors(path / "optimizer.pt")
        for group, live in zip(saved["param_groups"], optimizer.param_groups):
            for key in ("fused", "foreach"):  # the implementation is where we run, not where we saved
                if key in live:
                    group[key] = live[key]
        optimizer.load_state_dict(saved)
    scheduler.load_state_dict(_load_tensors(path / "scheduler.pt"))
    set_rng_state(_load_tensors(path / "rng.pt"))
    return json.loads((path / "state.json").read_text())


def _load_tensors(file: Path):
    """torch.load restricted to tensors and plain containers: a pickle that would run code is refused."""
    try:
        return torch.load(file, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise ValueError(f"refused to load {file}: it holds objects other than tensors and plain "
                         "containers (torch.load(weights_only=True) rejected it), so the checkpoint may "
                         "have been tampered with. Delete it and resume from an older checkpoint.") from exc


def _sizes_match(manifest_text: str | None, size_of) -> bool:
    """The manifest parses, lists the required files, and ``size_of(name)`` (None if absent) is
    every listed file's recorded size."""
    try:
        manifest = json.loads(manifest_text or "null")
        return isinstance(manifest, dict) and has_required(manifest) and all(
            size_of(n) == m["size"] for n, m in manifest.items())
    except (OSError, ValueError, KeyError, TypeError):  # OSError: a file removed while looking
        return False


def complete(path: str | Path) -> bool:
    """Cheap check (no checksums): the manifest parses and every file has its recorded size."""
    path = Path(path)
    try:
        text = (path / MANIFEST).read_text()
    except OSError:
        return False
    return _sizes_match(text, lambda n: (path / n).stat().st_size if (path / n).is_file() else None)


def prune(ckpt_root: str | Path, keep: int, written: str | None = None) -> None:
    """Delete all but the newest ``keep`` complete checkpoints, damaged ones and stale temp dirs.

    Damaged (incomplete) checkpoints do not count towards ``keep``: two of them newer than the
    one just written must not push the good ones out. ``written`` (the name just saved) is always
    kept, and nothing newer than it (a leftover of an earlier attempt, complete in size but
    perhaps not in checksum) is counted or deleted.
    """
    root = Path(ckpt_root)
    if keep:  # keep=0: keep everything
        _prune_names(storage.list_dirs(str(root)), keep, written, lambda n: complete(root / n),
                     lambda n: shutil.rmtree(root / n, ignore_errors=True))
    for tmp in root.glob(f".{PREFIX}*"):
        shutil.rmtree(tmp, ignore_errors=True)


def stored_complete(uri: str) -> bool:
    """``complete`` for a checkpoint in storage: on S3, its manifest (uploaded last) parses, lists
    the required files, and every file it lists is there with its recorded size."""
    if not storage.is_s3(uri):
        return complete(uri)
    return _sizes_match(storage.read_text(storage.join(uri, MANIFEST)), storage.s3_file_sizes(uri).get)


def prune_stored(root_uri: str, keep: int, written: str) -> None:
    """``prune`` for the copies in storage (a local dir or an S3 prefix), after ``written`` (a
    checkpoint name) was uploaded: it and the newest older complete ones, ``keep`` in all, stay;
    older ones go, incomplete ones too. Anything newer than ``written`` (a damaged leftover of an
    earlier attempt) is neither counted nor deleted. keep=0 keeps everything."""
    if not keep:
        return
    if not storage.is_s3(root_uri):
        prune(root_uri, keep, written)
        return
    _prune_names(storage.list_dirs(root_uri), keep, written, lambda n: stored_complete(storage.join(root_uri, n)),
                 lambda n: storage.delete_dir(storage.join(root_uri, n)))


def _prune_names(names, keep: int, written: str | None, is_complete, delete) -> None:
    """The pruning rule of ``prune`` and ``prune_stored``, over checkpoint ``names``: newest first,
    ``written`` and complete ones are kept up to ``keep``, the rest deleted; names newer than
    ``written`` are left alone."""
    kept = 0
    for name in sorted((n for n in names if n.startswith(PREFIX) and (written is None or n <= written)),
                       reverse=True):
        if name == written or (kept < keep and is_complete(name)):
            kept += 1
        else:
            delete(name)
