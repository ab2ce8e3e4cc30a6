"""A stage's checkpoints: save (local, then the run's storage), prune, find and load on resume,
republish, and the final model.

Rank 0 reads and writes; on resume it finds the newest complete, checksum-verified checkpoint
(this stage's local dir, then each ``resume_from`` location, e.g. a flow ``resume``'s origin
run) and broadcasts the path, so every rank loads the same one. A rank on another node, which
cannot see rank 0's disk, fetches the same checkpoint from storage. Housekeeping (pruning old
copies in storage) never stops training.
"""
from __future__ import annotations

import warnings
from pathlib import Path

from grpo_core.io import storage
from grpo_core.model.loading import save_policy
from grpo_core.policy import dist
from grpo_core.train import checkpoint


class StageCheckpoints:
    def __init__(self, cfg, info: dist.DistInfo, out: Path):
        self.cfg, self.info = cfg, info
        self.dir = out / "checkpoints"
        self.scratch = out / ".downloaded"

    def find_latest(self) -> Path | None:
        """The newest verified checkpoint, the same one on every rank (None: start at 0)."""
        locations = [str(self.dir)] + [storage.join(u, "checkpoints") for u in self.cfg.runtime.resume_from]
        path = checkpoint.latest(locations, self.scratch) if self.info.is_main else None
        found = dist.broadcast_str(str(path) if path else "")
        return self.readable(Path(found)) if found else None

    def readable(self, chosen: Path) -> Path:
        """``chosen`` (rank 0's path) where this rank can read it: that path when this rank sees
        it (one node), else the same checkpoint fetched from the stage's storage into a scratch
        dir of this rank's own."""
        if chosen.is_dir():
            return chosen
        name = checkpoint.name_of(chosen)
        stored = [storage.join(u, "checkpoints") for u in self.cfg.runtime.resume_from]
        for loc in stored:
            got = checkpoint.fetch(loc, name, self.scratch / f"rank-{self.info.rank}")
            if got:
                return got
        raise RuntimeError(f"rank {self.info.rank} cannot read checkpoint {name}: rank 0 chose {chosen} on "
                           f"its own disk, and no verified copy is under {stored}. Multi-node resume reads "
                           "checkpoints from storage: give the stage an s3:// storage_root every node reaches.")

    def load(self, path: Path, model, opt, sched, read_shards=None) -> dict:
        """Weights, optimizer, schedule and RNG state into the given objects; returns the stage
        state. ``read_shards(path)``: a sharded policy's reader (every rank calls it)."""
        return checkpoint.load(path, model, opt, sched, read_shards)

    def republish(self, ckpt: Path, iteration: int) -> None:
        """Copy a checkpoint found elsewhere (the origin run of a flow ``resume``) to this run's
        own sync_uri. A resume of this run searches only this run and its direct origin: if this
        run failed before writing a checkpoint of its own, the work would otherwise restart at 0."""
        if not (self.info.is_main and self.cfg.runtime.sync_uri):
            return
        copy = storage.join(self.cfg.runtime.sync_uri, "checkpoints", checkpoint.name_for(iteration))
        if not checkpoint.stored_complete(copy):  # absent, or an earlier republish cut short
            storage.put_dir(ckpt, copy)

    def save(self, iteration: int, model, opt, sched, state: dict, extra_files: dict[str, Path],
             write_shards=None) -> None:
        """Rank 0: an atomic local checkpoint (with ``extra_files`` copied in), its copy in the
        run's storage, then pruning to ``checkpoint.keep`` in both. Other ranks do nothing,
        except for a sharded policy: then every rank calls ``write_shards(dir)`` with the one
        temporary directory rank 0 is filling (sent to them), before rank 0 completes it."""
        into_agreed_dir = None
        if write_shards is not None:
            def into_agreed_dir(tmp: Path | None) -> None:
                write_shards(Path(dist.broadcast_str(str(tmp) if tmp else "")))

            if not self.info.is_main:
                into_agreed_dir(None)
        if not self.info.is_main:
            return
        path = checkpoint.save(self.dir, iteration, model, opt, sched, state, extra_files, into_agreed_dir)
        if self.cfg.runtime.sync_uri:
            remote = storage.join(self.cfg.runtime.sync_uri, "checkpoints")
            storage.put_dir(path, storage.join(remote, path.name))
            try:  # housekeeping: a bucket that refuses deletes must not stop training
                checkpoint.prune_stored(remote, self.cfg.checkpoint.keep, written=path.name)
            except Exception as exc:
                warnings.warn(f"could not prune old checkpoints under {remote}: {exc}")
        checkpoint.prune(self.dir, self.cfg.checkpoint.keep, written=path.name)

    def publish_final(self, model, tok, out: Path, state_dict: dict | None = None) -> str:
        """Rank 0: the stage's final model as a safetensors HF dir (``state_dict``: its weights,
        when the model's own are sharded), copied to storage when the stage has a sync_uri;
        returns where the next stage loads it from."""
        final = save_policy(model, tok, out / "final", state_dict)
        if self.cfg.runtime.sync_uri:
            return storage.put_dir(final, storage.join(self.cfg.runtime.sync_uri, "final"))
        return str(final)
