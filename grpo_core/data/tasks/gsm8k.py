"""The GSM8K task: grade-school word problems, from the hub or a local copy (``datasets``).

Loads ``openai/gsm8k`` (config ``main``) or a local directory of ``train.jsonl``/``test.jsonl``
(``GSM8K_DIR``, which wins over the configured source) through the same ``datasets`` call. A
malformed row is an error naming its index; nothing is dropped silently. "test" is GSM8K's test
split; "validation" is a 5% hash slice of the train split's questions, never trained on; "train"
is the rest. Each row carries its ``steps``: the calculator annotations (``<<48/2=24>>``) in the
reference solution, GSM8K's own measure of how many operations a problem takes.

Params: ``gsm8k_source`` (a hub id or a dir) and ``gsm8k_max_steps`` (keep problems of at most that
many steps; 0 keeps all). The bound applies to every split read with it: a stage trains on easy
problems with it, and an evaluation set ``gsm8k_test_le2`` reads the test split with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from grpo_core.data.answers import gold_value
from grpo_core.data.tasks import Task, bucket, check_split

VALIDATION_PERCENT = 5  # share of train questions kept out of training for validation
CALCULATOR = re.compile(r"<<[^<>]*>>")  # one calculator step of a reference solution


def rows(split: str, gsm8k_source: str = "openai/gsm8k", gsm8k_max_steps: int = 0,
         limit: int | None = None) -> list[dict]:
    """GSM8K rows of ``split`` with at most ``gsm8k_max_steps`` steps (0: any), the first ``limit``."""
    check_split(split)
    check_max_steps(gsm8k_max_steps)
    out = load(gsm8k_source, "test" if split == "test" else "train")
    if split != "test":
        out = [r for r in out if (bucket(r["prompt"]) < VALIDATION_PERCENT) == (split == "validation")]
    if gsm8k_max_steps:
        out = [r for r in out if r["steps"] <= gsm8k_max_steps]
    return out[:limit] if limit is not None else out


def check_max_steps(gsm8k_max_steps) -> None:
    if isinstance(gsm8k_max_steps, bool) or not isinstance(gsm8k_max_steps, int) or gsm8k_max_steps < 0:
        raise ValueError(f"gsm8k_max_steps must be an integer >= 0 (0 keeps every problem), got {gsm8k_max_steps!r}")


def steps_of(answer: str) -> int:
    """Calculator steps of a reference solution: its ``<<expression=value>>`` annotations."""
    return len(CALCULATOR.findall(answer))


def identity(split: str, gsm8k_source: str = "openai/gsm8k", gsm8k_max_steps: int = 0) -> dict:
    """Source and digest of one split. The digest is sha256 of the file split's rows in order
    (question, reasoning, gold) and of the steps bound, so the hub and a local copy of the same data
    agree and any changed row or bound changes it; train and validation share the train file's
    digest (fixed slices of it)."""
    slice_ = f"{VALIDATION_PERCENT}% of the train split by question hash"
    described = {"train": f"train (less the validation {slice_})",
                 "validation": f"validation ({slice_}; never trained on)", "test": "test"}
    check_split(split)
    check_max_steps(gsm8k_max_steps)
    bound = f", problems of <= {gsm8k_max_steps} calculator steps" if gsm8k_max_steps else ""
    h = hashlib.sha256(f"max_steps={gsm8k_max_steps}\n".encode() if gsm8k_max_steps else b"")
    for r in load(gsm8k_source, "test" if split == "test" else "train"):
        h.update(json.dumps([r["prompt"], r["think"], r["gold"]]).encode() + b"\n")
    return {"source": gsm8k_source, "split": described[split] + bound, "digest": h.hexdigest()[:16]}


def resolve(params: dict) -> dict:
    return {**params, "gsm8k_source": resolve_source(params["gsm8k_source"])}


def resolve_source(configured: str) -> str:
    """GSM8K_DIR (a local copy) wins over the configured hub id / path; local paths made absolute."""
    src = os.environ.get("GSM8K_DIR") or configured
    return os.path.abspath(src) if os.path.isdir(src) else src


def _files(source: str) -> dict[str, str] | None:
    p = Path(source)
    if not p.is_dir():
        if p.is_absolute() or source.startswith((".", "~")):
            raise FileNotFoundError(f"GSM8K directory {source} does not exist; point GSM8K_DIR (or "
                                    "gsm8k_source) at a local copy of openai/gsm8k 'main' with "
                                    "train.jsonl/test.jsonl, or use the hub id openai/gsm8k")
        return None
    files = {s: str(p / f"{s}.jsonl") for s in ("train", "test") if (p / f"{s}.jsonl").is_file()}
    if not files:
        raise FileNotFoundError(f"GSM8K directory {source} has no train.jsonl/test.jsonl; "
                                "point GSM8K_DIR at a copy of openai/gsm8k 'main'")
    return files


def load(source: str, split: str, limit: int | None = None) -> list[dict]:
    """GSM8K rows of one file split (train | test) from a hub id or a local dir, validated."""
    import datasets

    files = _files(source)
    if files is not None:
        if split not in files:
            raise FileNotFoundError(f"GSM8K directory {source} has no {split}.jsonl")
        _check_jsonl(files[split])
        ds = datasets.load_dataset("json", data_files={split: files[split]}, split=split)
        where = files[split]
    else:
        ds = datasets.load_dataset(source, "main", split=split)
        where = f"{source} split {split!r}"
    if len(ds) == 0:
        raise ValueError(f"GSM8K {where} is empty")
    out = []
    for i, ex in enumerate(ds):
        if limit is not None and i >= limit:
            break
        q, a = ex.get("question"), ex.get("answer")
        if not isinstance(q, str) or not q.strip() or not isinstance(a, str) or not a.strip():
            raise ValueError(f"GSM8K {where} row {i} (0-based): needs non-empty string fields 'question' "
                             f"and 'answer', got question={q!r:.60} answer={a!r:.60}; fix or drop that row")
        try:
            gold = gold_value(a)
        except ValueError as exc:
            raise ValueError(f"GSM8K {where} row {i} (0-based): gold answer is not a number ({exc})") from exc
        think = a.rsplit("####", 1)[0].strip()
        out.append({"id": f"gsm8k_{split}:{i}", "prompt": q, "gold": _plain(gold), "think": think,
                    "steps": steps_of(a)})
    return out


def _plain(x) -> str:
    """A gold number as plain decimal text: 1234, -3, 2.5 (never '5/2')."""
    if getattr(x, "denominator", 1) == 1:
        return str(int(x))
    return repr(float(x))


def _check_jsonl(path: str) -> None:
    """A local split file must hold at least one JSON object per line; name the bad line."""
    seen = False
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as exc:
                raise ValueError(f"{path} line {n} is not valid JSON ({exc}); each line must be one "
                                 "object like {\"question\": ..., \"answer\": \"... #### 42\"}") from exc
            if not isinstance(obj, dict):
                raise ValueError(f"{path} line {n} is a JSON {type(obj).__name__}, not an object with "
                                 "'question' and 'answer'")
            seen = True
    if not seen:
        raise ValueError(f"{path} is empty; it needs one JSON object per line with 'question' and 'answer' "
                         "(a copy of openai/gsm8k 'main')")


TASK = Task("gsm8k", ("gsm8k_source", "gsm8k_max_steps"), rows, identity, resolve=resolve,
            difficulty_param="gsm8k_max_steps", eval_defaults=(("size", 100),),
            unreadable_hint="Offline, point GSM8K_DIR at a local copy with train.jsonl/test.jsonl (e.g. "
                            "GSM8K_DIR=../shared/data/gsm8k); online, the hub id openai/gsm8k works as is.")
