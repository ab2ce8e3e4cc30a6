"""The arithmetic task: every ``a op b`` over an operand range, generated (no download).

Problems are split by a hash of the problem, with ``a+b``/``b+a`` (and ``*``) hashed alike so a
commuted twin never sits on the other side of a split: 15% test, 10% validation, the rest train.
Params: ``arithmetic_ops`` (a subset of "+-*"), ``arithmetic_min``..``arithmetic_max`` (operands, inclusive).
"""
from __future__ import annotations

import hashlib
import itertools

from grpo_core.data.tasks import Task, bucket, check_split

TEST_PERCENT = 15  # share of problems reserved for the final evaluation
VALIDATION_PERCENT = 10  # share of problems for periodic evaluation and the gate
OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def split_of(a: int, op: str, b: int) -> str:
    """The split of ``a op b``; commutative problems are keyed on the sorted operands."""
    if op in "+*":
        a, b = min(a, b), max(a, b)
    k = bucket(f"{a}{op}{b}")
    return "test" if k < TEST_PERCENT else "validation" if k < TEST_PERCENT + VALIDATION_PERCENT else "train"


def rows(split: str = "train", arithmetic_ops: str = "+-*", arithmetic_min: int = 0,
         arithmetic_max: int = 20) -> list[dict]:
    """All ``a op b`` problems in range that fall in ``split`` (train | validation | test)."""
    check_split(split)
    operands = range(arithmetic_min, arithmetic_max + 1)
    out = []
    for a, op, b in itertools.product(operands, arithmetic_ops, operands):
        if split_of(a, op, b) == split:
            value = OPS[op](a, b)
            out.append({"id": f"arith:{a}{op}{b}", "prompt": f"What is {a} {op} {b}?",
                        "gold": str(value), "think": f"{a}{op}{b}={value}"})
    if not out:
        raise ValueError(f"arithmetic range ops={arithmetic_ops!r} {arithmetic_min}..{arithmetic_max} leaves "
                         f"no {split} problems; widen the range (arithmetic_min, arithmetic_max)")
    return out


def identity(split: str, arithmetic_ops: str = "+-*", arithmetic_min: int = 0, arithmetic_max: int = 20) -> dict:
    """Source and digest (sha256 of the split's problem ids, in order) of one split."""
    ids = "\n".join(r["id"] for r in rows(split, arithmetic_ops, arithmetic_min, arithmetic_max))
    return {"source": f"arithmetic:{arithmetic_ops}:{arithmetic_min}..{arithmetic_max}", "split": split,
            "digest": hashlib.sha256(ids.encode()).hexdigest()[:16]}


TASK = Task("arithmetic", ("arithmetic_ops", "arithmetic_min", "arithmetic_max"), rows, identity, shuffled_subsets=True)
