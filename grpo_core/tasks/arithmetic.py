"""The arithmetic task: every ``a op b`` over an operand range, generated (no download).

Problems are split by a hash of the problem, with ``a+b``/``b+a`` (and ``*``) hashed alike so a
commuted twin never sits on the other side of a split: 15% test, 10% validation, the rest train.
Params: ``arith_ops`` (a subset of "+-*"), ``arith_min``..``arith_max`` (operands, inclusive).
"""
from __future__ import annotations

import hashlib
import itertools

from grpo_core.tasks import Task, bucket, check_split

TEST_PERCENT = 15  # share of problems reserved for the final evaluation
VALIDATION_PERCENT = 10  # share of problems for periodic evaluation and the gate
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def split_of(a: int, op: str, b: int) -> str:
    """The split of ``a op b``; commutative problems are keyed on the sorted operands."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    k = bucket(f"{a}{op}{b}")
    return "test" if k < TEST_PERCENT else "validation" if k < TEST_PERCENT + VALIDATION_PERCENT else "train"


def rows(split: str = "train", arith_ops: str = "+-*", arith_min: int = 0, arith_max: int = 20) -> list[dict]:
    """All ``a op b`` problems in range that fall in ``split`` (train | validation | test)."""
    check_split(split)
    out = []
    for a, op, b in itertools.product(range(arith_min, arith_max + 1), arith_ops, range(arith_min, arith_max + 1)):
        if split_of(a, op, b) == split:
            value = OPS[op](a, b)
            out.append({"id": f"arith:{a}{op}{b}", "prompt": f"What is {a} {op} {b}?",
                        "gold": str(value), "think": f"{a}{op}{b}={value}"})
    if not out:
        raise ValueError(f"arithmetic range ops={arith_ops!r} {arith_min}..{arith_max} leaves no {split} "
                         "problems; widen the range (arith_min, arith_max)")
    return out


def identity(split: str, arith_ops: str = "+-*", arith_min: int = 0, arith_max: int = 20) -> dict:
    """Source and digest (sha256 of the split's problem ids, in order) of one split."""
    ids = "\n".join(r["id"] for r in rows(split, arith_ops, arith_min, arith_max))
    return {"source": f"arithmetic:{arith_ops}:{arith_min}..{arith_max}", "split": split,
            "digest": hashlib.sha256(ids.encode()).hexdigest()[:16]}


TASK = Task("arithmetic", ("arith_ops", "arith_min", "arith_max"), rows, identity, shuffled_subsets=True)
