"""Write a run's three cards and the artifacts they show, for the browser tests.

Usage: ``python tests/newcomer_cards.py RUN_ID OUT_DIR``, run in the project with its Metaflow
environment (a process of its own: Metaflow reads its datastore settings when imported). Writes
``training.html`` (curriculum_grpo), ``evaluation.html`` (join_evaluations), ``registry.html``
(register) and ``artifacts.json``: the evaluation results, the registry decision and the
curriculum stage's summary, as the flow stored them.
"""
import json
import math
import sys
from pathlib import Path

from metaflow import Run, namespace
from metaflow.cards import get_cards

CARDS = {"training": "curriculum_grpo", "evaluation": "join_evaluations", "registry": "register"}


def finite(obj):
    """``obj`` with non-finite floats as None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def main(run_id: str, out: Path) -> None:
    namespace(None)
    run = Run(f"GRPOFlow/{run_id}")
    for card_id, step in CARDS.items():
        [card] = get_cards(run[step].task, id=card_id)
        (out / f"{card_id}.html").write_text(card.get())
    artifacts = {"results": run["join_evaluations"].task["results"].data,
                 "registry": run["register"].task["registry"].data,
                 "curriculum": run["curriculum_grpo"].task["curriculum"].data}
    (out / "artifacts.json").write_text(json.dumps(finite(artifacts), default=str))


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]))
