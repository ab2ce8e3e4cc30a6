"""Data splits: training, the validation the gate selects on, and the test the evaluation reports
are disjoint, so no reported accuracy is chosen on the items it reports."""
import os

import pytest

from grpo_core.config.pipeline import PipelineConfig
from grpo_core.config.stage import GRPOConfig
from grpo_core.data.prompts import eval_rows, train_rows
from grpo_core.data.tasks import SPLITS, arithmetic, gsm8k
from grpo_core.evaluation.greedy import eval_sets
from tests.helpers import GSM8K_DIR, require_gsm8k

needs_gsm8k = pytest.mark.usefixtures("gsm8k_dir")


@pytest.fixture
def gsm8k_dir():
    return require_gsm8k()


def _ids(rows):
    return {r["id"] for r in rows}


def test_arithmetic_splits_are_disjoint_cover_everything_and_keep_commuted_twins_together():
    splits = {s: arithmetic.rows(s, "+-*", 0, 20) for s in SPLITS}
    ids = [_ids(rows) for rows in splits.values()]
    assert sum(map(len, ids)) == len(set().union(*ids)) == 21 * 21 * 3
    shares = {s: len(rows) / (21 * 21 * 3) for s, rows in splits.items()}
    assert 0.11 < shares["test"] < 0.19 and 0.07 < shares["validation"] < 0.13, shares
    for a in range(21):
        for b in range(21):
            for op in "+*":
                assert arithmetic.split_of(a, op, b) == arithmetic.split_of(b, op, a), (a, op, b)
    # subtraction is not commutative: 3-5 and 5-3 are different problems and may split apart
    assert any(arithmetic.split_of(a, "-", b) != arithmetic.split_of(b, "-", a) for a in range(21) for b in range(21))
    with pytest.raises(ValueError, match="split must be one of"):
        arithmetic.rows(split="holdout")


def test_the_curriculum_gate_selects_on_validation_and_the_evaluation_reports_test():
    cfg = PipelineConfig.from_dict({"evaluate": {"gsm8k": {"size": -1}, "arithmetic": {"size": 500}},
                                    "register": {"primary": "arithmetic_test"}})
    stage = GRPOConfig(task="arithmetic", runtime=dict(model="-"))
    validation, training = _ids(eval_rows(stage, 10_000)), _ids(train_rows(stage))
    params = arithmetic.TASK.params_of(cfg.stage("curriculum", model="-"))
    reported = _ids(eval_sets(cfg.evaluate, {"arithmetic_test": params})["arithmetic_test"])
    assert validation and training and reported
    assert not validation & training and not validation & reported and not reported & training


@needs_gsm8k
def test_gsm8k_validation_comes_from_train_and_is_never_trained_on(monkeypatch):
    monkeypatch.setenv("GSM8K_DIR", str(GSM8K_DIR))
    source = str(GSM8K_DIR)
    train, validation = gsm8k.rows("train", source), gsm8k.rows("validation", source)
    assert len(train) + len(validation) == 7473 and 0.03 < len(validation) / 7473 < 0.07
    assert not _ids(train) & _ids(validation)
    stage = GRPOConfig(task="gsm8k", runtime=dict(model="-"), gsm8k_source=source)
    periodic = eval_rows(stage, 100)
    assert len(periodic) == 100 and _ids(periodic) <= _ids(validation)
    assert not _ids(periodic) & _ids(train_rows(stage))
    assert [r["id"] for r in gsm8k.rows("test", source, limit=3)] == ["gsm8k_test:0", "gsm8k_test:1", "gsm8k_test:2"]


def test_sft_rows_too_long_lose_reasoning_never_the_answer_or_the_stop():
    """A row over the token budget is cut inside its <think> text: the answer tail and eos stay
    (cut from the end, 3,372 of 7,116 GSM8K rows lost their answer); a row whose prompt and
    tail alone overflow is dropped, not taught without an answer."""
    from grpo_core.model.loading import build_tiny
    from grpo_core.pipeline.sft import encode_examples

    _, tok = build_tiny("llama", 16, 1, 2, seed=0)
    rows = [{"prompt": "1+2=", "think": "1+2=3", "gold": 3},
            {"prompt": "How many?", "think": "we add " * 40, "gold": 1234},
            {"prompt": "x" * 120, "think": "short", "gold": 5}]
    out = encode_examples(tok, rows, max_tokens=100)
    assert len(out) == 2  # the third row's prompt alone fills the budget
    for (ids, plen), row in zip(out, rows):
        assert len(ids) <= 100 and ids[-1] == tok.eos_token_id
        target = tok.decode(ids[plen:-1])
        assert target.startswith("<think>") and target.endswith(f"</think><answer>{row['gold']}</answer>")
    assert tok.decode(out[0][0][out[0][1]:-1]) == "<think>1+2=3</think><answer>3</answer>"  # short rows whole


def test_gsm8k_digest_is_of_the_rows_not_of_the_file_or_its_name(tmp_path):
    """The registry compares two models item by item only when their test data digests agree: a
    copy of the same rows (hub or local, any formatting, any path) must agree, a changed row not."""
    import json

    rows = [{"question": f"Tom has {n} apples and eats 1. How many are left?",
             "answer": f"{n} - 1 = {n - 1}\n#### {n - 1}"} for n in range(2, 8)]

    def write(name, lines):
        d = tmp_path / name
        d.mkdir()
        (d / "test.jsonl").write_text("\n".join(lines) + "\n")
        return str(d)

    compact = write("a", [json.dumps(r) for r in rows])
    spaced = write("b", [json.dumps({"answer": r["answer"], "question": r["question"], "extra": 1}, indent=None,
                                    separators=(" , ", " : ")) for r in rows])
    changed = write("c", [json.dumps({**r, "answer": r["answer"].replace("#### 6", "#### 7")}) for r in rows])
    assert gsm8k.identity("test", compact)["digest"] == gsm8k.identity("test", spaced)["digest"]
    assert gsm8k.identity("test", compact)["digest"] != gsm8k.identity("test", changed)["digest"]
    reordered = write("d", [json.dumps(r) for r in rows[::-1]])
    assert gsm8k.identity("test", compact)["digest"] != gsm8k.identity("test", reordered)["digest"]


PARITY_TASK = """
from grpo_core.data.tasks import Task, bucket


def rows(split, arithmetic_max=20):
    out = [{"id": f"parity:{n}", "prompt": f"Is {n} odd? Answer 1 for yes, 0 for no.", "gold": str(n % 2)}
           for n in range(arithmetic_max + 1)]
    return [r for r in out if ("test" if bucket(r["id"]) < 30 else "validation" if bucket(r["id"]) < 50
                               else "train") == split]


def identity(split, arithmetic_max=20):
    return {"source": f"parity:0..{arithmetic_max}", "split": split, "digest": str(len(rows(split, arithmetic_max)))}


TASK = Task("parity", ("arithmetic_max",), rows, identity)
"""


def test_a_new_task_is_one_file_that_config_training_and_evaluation_pick_up(tmp_path, monkeypatch):
    """Dropping a module that defines TASK into the tasks package is the whole change: the stage
    config accepts its name, training and the gate read its splits, the evaluation its test split."""
    import grpo_core.data.tasks as tasks_pkg
    from grpo_core.config.checks import ConfigError
    from grpo_core.config.evaluation import EvalConfig

    (tmp_path / "parity.py").write_text(PARITY_TASK)
    with pytest.raises(ConfigError, match="parity"):
        GRPOConfig(task="parity", runtime=dict(model="-"))
    monkeypatch.setattr(tasks_pkg, "__path__", [*tasks_pkg.__path__, str(tmp_path)])
    tasks_pkg.registry.cache_clear()
    try:
        stage = GRPOConfig(task="parity", runtime=dict(model="-"), arithmetic_max=99)
        train, validation = _ids(train_rows(stage)), _ids(eval_rows(stage, 1000))
        assert train and validation and not train & validation and len(train | validation) < 100
        test = eval_sets(EvalConfig(), {"parity_test": {"arithmetic_max": 99}})  # size 300 > the split: all
        assert list(test) == ["parity_test"] and not _ids(test["parity_test"]) & (train | validation)
        assert tasks_pkg.split_of("parity_validation") == (tasks_pkg.task("parity"), "validation")
    finally:
        tasks_pkg.registry.cache_clear()


@needs_gsm8k
def test_the_run_fingerprints_every_split_of_every_stage_task_by_one_name(monkeypatch, tmp_path):
    """``start`` records each stage task's train/validation/test as <task>_<split>, with the params
    it read (GSM8K_DIR resolved), so training pods and the evaluation read what was fingerprinted;
    data that cannot be read stops it with the dataset's name and the fix."""
    from grpo_core.pipeline.steps import dataset_identities

    monkeypatch.setenv("GSM8K_DIR", str(GSM8K_DIR))
    found = dataset_identities(PipelineConfig.from_dict({"curriculum": {"arithmetic_max": 30}}))
    assert set(found) == {f"{t}_{s}" for t in ("arithmetic", "gsm8k") for s in SPLITS}
    assert found["gsm8k_test"]["params"] == {"gsm8k_source": os.path.abspath(GSM8K_DIR), "gsm8k_max_steps": 0}
    assert found["arithmetic_test"]["params"] == {"arithmetic_ops": "+-*", "arithmetic_min": 0, "arithmetic_max": 30}
    assert found["arithmetic_test"]["source"] == "arithmetic:+-*:0..30"
    assert found["gsm8k_train"]["digest"] == found["gsm8k_validation"]["digest"] != found["gsm8k_test"]["digest"]
    monkeypatch.setenv("GSM8K_DIR", str(tmp_path / "missing"))
    with pytest.raises(RuntimeError, match=r"gsm8k_train could not be read .* point GSM8K_DIR"):
        dataset_identities(PipelineConfig.from_dict({}))
