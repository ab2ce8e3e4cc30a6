"""Prompts and gold answers: the arithmetic curriculum (generated) and GSM8K (``datasets``).

Every row is ``{"id": str, "prompt": str, "gold": str}``; ``prompt`` is the raw question and the
tokenizer's chat template wraps it. GSM8K loads from the hub id ``openai/gsm8k`` (config
``main``) or from a local directory of ``train.jsonl``/``test.jsonl`` (``GSM8K_DIR``), through
the same ``datasets`` call. A malformed row is an error naming its index; nothing is dropped
silently.

Three disjoint splits, so no reported accuracy is chosen on the data it reports: training draws
only "train"; the periodic evaluation and the promotion gate during a stage use "validation";
the final evaluation of every stage uses "test". Arithmetic problems are split by a hash of the
problem, with ``a+b``/``b+a`` (and ``*``) hashed alike so a commuted twin never sits on the other
side (15% test, 10% validation). GSM8K keeps its own test split as "test" and takes
"validation" from its train split (a 5% hash slice of the questions, never trained on).
"""
from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import torch

from grpo_core.answers import gold_value

SPLITS = ("train", "validation", "test")
TEST_PERCENT = 15  # share of arithmetic problems reserved for the final evaluation
VALIDATION_PERCENT = 10  # share of arithmetic problems for periodic evaluation and the gate
GSM8K_VALIDATION_PERCENT = 5  # share of GSM8K train questions kept out of training for validation
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
SFT_FORMAT = "<think>{think}</think><answer>{answer}</answer>"


def _bucket(key: str) -> int:
    return int(hashlib.sha1(key.encode()).hexdigest(), 16) % 100


def arithmetic_split(a: int, op: str, b: int) -> str:
    """The split of ``a op b``; commutative problems are keyed on the sorted operands."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    bucket = _bucket(f"{a}{op}{b}")
    return "test" if bucket < TEST_PERCENT else "validation" if bucket < TEST_PERCENT + VALIDATION_PERCENT \
        else "train"


def _check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")


def arithmetic_rows(ops: str = "+-*", lo: int = 0, hi: int = 20, split: str = "train") -> list[dict]:
    """All ``a op b`` problems in range that fall in ``split`` (train | validation | test)."""
    _check_split(split)
    rows = []
    for a, op, b in itertools.product(range(lo, hi + 1), ops, range(lo, hi + 1)):
        if arithmetic_split(a, op, b) == split:
            rows.append({"id": f"arith:{a}{op}{b}", "prompt": f"What is {a} {op} {b}?",
                         "gold": str(OPS[op](a, b)), "think": f"{a}{op}{b}={OPS[op](a, b)}"})
    if not rows:
        raise ValueError(f"arithmetic range ops={ops!r} {lo}..{hi} leaves no {split} problems; widen the range")
    return rows


def gsm8k_rows(source: str, split: str, limit: int | None = None) -> list[dict]:
    """GSM8K rows of ``split``: test is GSM8K's test split (the first ``limit``); train and
    validation divide its train split by a hash of the question (validation is never trained on)."""
    _check_split(split)
    if split == "test":
        return load_gsm8k(source, "test", limit=limit)
    rows = [r for r in load_gsm8k(source, "train")
            if (_bucket(r["prompt"]) < GSM8K_VALIDATION_PERCENT) == (split == "validation")]
    return rows[:limit] if limit is not None else rows


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
    """A content digest for lineage: sha256 of the split's rows in order (question, reasoning, gold),
    so the same data read from the hub or from a local copy has the same digest (the registry
    compares models item by item only on equal digests) and any changed row changes it."""
    h = hashlib.sha256()
    for r in load_gsm8k(source, split):
        h.update(json.dumps([r["prompt"], r["think"], r["gold"]]).encode() + b"\n")
    return h.hexdigest()[:16]


def arithmetic_digest(ops: str, lo: int, hi: int, split: str) -> str:
    rows = arithmetic_rows(ops, lo, hi, split)
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
    """Training rows for a GRPOConfig (the train split of its task)."""
    from grpo_core.config import gsm8k_source

    if cfg.task == "arithmetic":
        return arithmetic_rows(cfg.arith_ops, cfg.arith_min, cfg.arith_max, "train")
    return gsm8k_rows(gsm8k_source(cfg.gsm8k_source), "train")


def eval_rows(cfg, size: int) -> list[dict]:
    """A fixed subset of the validation split for periodic evaluation and the promotion gate:
    disjoint from training and from the test items the final evaluation reports."""
    from grpo_core.config import gsm8k_source

    if cfg.task == "arithmetic":
        rows = arithmetic_rows(cfg.arith_ops, cfg.arith_min, cfg.arith_max, "validation")
    else:
        rows = gsm8k_rows(gsm8k_source(cfg.gsm8k_source), "validation")
    return fixed_subset(rows, size)


def fixed_subset(rows: list[dict], size: int) -> list[dict]:
    """The same ``size`` rows (all, if fewer) on every call: a seeded shuffle's first ones."""
    return PromptStream(rows, seed=12345).take(0, min(size, len(rows)))
