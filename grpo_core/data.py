"""Prompts and gold answers: the arithmetic curriculum (generated) and GSM8K (``datasets``).

Every row is ``{"id": str, "prompt": str, "gold": str}``; ``prompt`` is the raw question and the
tokenizer's chat template wraps it. GSM8K loads from the hub id ``openai/gsm8k`` (config
``main``) or from a local directory of ``train.jsonl``/``test.jsonl`` (``GSM8K_DIR``), through
the same ``datasets`` call. A malformed row is an error naming its index; nothing is dropped
silently. Arithmetic problems whose hash falls in a fixed 15% slice are held out: training never
draws them, evaluation uses only them, so the held-out accuracy is honest.
"""
from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

import torch

from grpo_core.rewards import gold_value

HOLDOUT_PERCENT = 15  # share of arithmetic problems reserved for evaluation
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SFT_FORMAT = "<think>{think}</think><answer>{answer}</answer>"


def _is_holdout(a: int, op: str, b: int) -> bool:
    return int(hashlib.sha1(f"{a}{op}{b}".encode()).hexdigest(), 16) % 100 < HOLDOUT_PERCENT


def arithmetic_rows(ops: str = "+-*", lo: int = 0, hi: int = 20, holdout: bool = False) -> list[dict]:
    """All ``a op b`` problems in range, either the training part or the held-out part."""
    rows = []
    for a, op, b in itertools.product(range(lo, hi + 1), ops, range(lo, hi + 1)):
        if _is_holdout(a, op, b) == holdout:
            rows.append({"id": f"arith:{a}{op}{b}", "prompt": f"What is {a} {op} {b}?",
                         "gold": str(OPS[op](a, b)), "think": f"{a}{op}{b}={OPS[op](a, b)}"})
    if not rows:
        raise ValueError(f"arithmetic range ops={ops!r} {lo}..{hi} leaves no "
                         f"{'held-out' if holdout else 'training'} problems; widen the range")
    return rows


def sft_target(row: dict) -> str:
    """The completion SFT teaches: reasoning in <think>, the number in <answer>."""
    return SFT_FORMAT.format(think=row.get("think", ""), answer=row["gold"])


def _gsm8k_files(source: str) -> dict[str, str] | None:
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


def load_gsm8k(source: str, split: str, limit: int | None = None) -> list[dict]:
    """GSM8K rows from a hub id or a local dir, validated; ``limit`` keeps the first N."""
    import datasets

    files = _gsm8k_files(source)
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
    rows = []
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
        rows.append({"id": f"gsm8k_{split}:{i}", "prompt": q, "gold": _fmt(gold), "think": think})
    return rows


def _check_jsonl(path: str) -> None:
    """A local split file must hold at least one JSON object per line; name the bad line."""
    import json

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


def _fmt(x) -> str:
    """A gold number as plain decimal text: 1234, -3, 2.5 (never '5/2')."""
    if getattr(x, "denominator", 1) == 1:
        return str(int(x))
    return repr(float(x))


def dataset_digest(source: str, split: str) -> str:
    """A content digest for lineage: sha256 of the local file, else the hub id + split."""
    files = _gsm8k_files(source) if not source.startswith("arith") else None
    if files and split in files:
        h = hashlib.sha256(Path(files[split]).read_bytes()).hexdigest()
    else:
        h = hashlib.sha256(f"{source}:{split}".encode()).hexdigest()
    return h[:16]


def arithmetic_digest(ops: str, lo: int, hi: int, holdout: bool) -> str:
    rows = arithmetic_rows(ops, lo, hi, holdout)
    return hashlib.sha256("\n".join(r["id"] for r in rows).encode()).hexdigest()[:16]


class PromptStream:
    """Deterministic, resumable order over rows: epoch-wise permutations seeded by (seed, epoch).

    ``take(position, n)`` is a pure function of its arguments, so a restarted stage that knows
    its data position draws exactly the prompts an uninterrupted run would have drawn.
    """

    def __init__(self, rows: list[dict], seed: int):
        if not rows:
            raise ValueError("no prompts to train on")
        self.rows, self.seed = rows, seed

    def _perm(self, epoch: int) -> list[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.rows), generator=g).tolist()

    def take(self, position: int, n: int) -> list[dict]:
        out, size = [], len(self.rows)
        while len(out) < n:
            epoch, offset = divmod(position + len(out), size)
            perm = self._perm(epoch)
            out.extend(self.rows[i] for i in perm[offset:offset + n - len(out)])
        return out


def train_rows(cfg) -> list[dict]:
    """Training rows for a GRPOConfig (arithmetic training part or GSM8K train)."""
    from grpo_core.config import gsm8k_source

    if cfg.task == "arithmetic":
        return arithmetic_rows(cfg.arith_ops, cfg.arith_min, cfg.arith_max, holdout=False)
    return load_gsm8k(gsm8k_source(cfg.gsm8k_source), "train")


def eval_rows(cfg, size: int) -> list[dict]:
    """A fixed held-out subset for periodic evaluation during a stage."""
    from grpo_core.config import gsm8k_source

    if cfg.task == "arithmetic":
        rows = arithmetic_rows(cfg.arith_ops, cfg.arith_min, cfg.arith_max, holdout=True)
        return PromptStream(rows, seed=12345).take(0, min(size, len(rows)))
    return load_gsm8k(gsm8k_source(cfg.gsm8k_source), "test", limit=size)
