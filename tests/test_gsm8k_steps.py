"""GSM8K difficulty as data: rows carry their calculator steps, a bound selects them, the bound is
part of a dataset's name, identity and digest, and the evaluation reports accuracy by steps."""
import json

import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.evaluation import EvalConfig
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.config.stage import GRPOConfig
from grpo_core.data import tasks
from grpo_core.data.tasks import gsm8k
from grpo_core.evaluation.greedy import eval_sets, summarize


def _answer(steps: int, gold: int) -> str:
    work = "\n".join(f"Step {i}: 1+{i} = <<1+{i}={1 + i}>>{1 + i}" for i in range(steps))
    return f"{work}\n#### {gold}"


@pytest.fixture
def gsm8k_dir(tmp_path):
    """A local GSM8K copy: problems of 0..6 steps, several of each, in train and test."""
    for split, n in (("train", 400), ("test", 28)):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(n):
                f.write(json.dumps({"question": f"{split} question {i}?", "answer": _answer(i % 7, i)}) + "\n")
    return tmp_path


def test_rows_carry_their_calculator_steps(gsm8k_dir):
    rows = gsm8k.rows("test", str(gsm8k_dir))
    assert [r["steps"] for r in rows[:8]] == [0, 1, 2, 3, 4, 5, 6, 0]
    assert gsm8k.steps_of("He pays <<2*3=6>>6 and <<6+1=7>>7.\n#### 7") == 2


@pytest.mark.parametrize("split", ["train", "validation", "test"])
def test_the_steps_bound_keeps_problems_of_at_most_that_many_steps(gsm8k_dir, split):
    every = gsm8k.rows(split, str(gsm8k_dir))
    easy = gsm8k.rows(split, str(gsm8k_dir), gsm8k_max_steps=2)
    assert easy == [r for r in every if r["steps"] <= 2] and 0 < len(easy) < len(every)
    assert gsm8k.rows(split, str(gsm8k_dir), gsm8k_max_steps=0) == every


def test_the_bound_changes_identity_and_digest_and_none_keeps_the_old_digest(gsm8k_dir):
    src = str(gsm8k_dir)
    plain, bounded = gsm8k.identity("test", src), gsm8k.identity("test", src, gsm8k_max_steps=2)
    assert plain["digest"] != bounded["digest"] and "<= 2 calculator steps" in bounded["split"]
    assert gsm8k.identity("test", src, gsm8k_max_steps=3)["digest"] != bounded["digest"]
    assert gsm8k.identity("test", src, gsm8k_max_steps=0) == plain
    with pytest.raises(ValueError, match="gsm8k_max_steps"):
        gsm8k.rows("test", src, gsm8k_max_steps=-1)


def test_a_bounded_dataset_name_parses_back_and_a_task_without_a_bound_refuses_one():
    assert tasks.dataset_name("gsm8k", "test", 2) == "gsm8k_test_le2"
    assert tasks.parse_dataset_name("gsm8k_test_le2") == (tasks.task("gsm8k"), "test", 2)
    assert tasks.split_of("gsm8k_test_le2") == (tasks.task("gsm8k"), "test")
    assert tasks.parse_dataset_name("gsm8k_test")[2] == 0
    with pytest.raises(KeyError, match="no difficulty bound"):
        tasks.parse_dataset_name("arithmetic_test_le2")


def test_a_stage_bound_is_a_validated_config_field():
    assert GRPOConfig(task="gsm8k", gsm8k_max_steps=2).gsm8k_max_steps == 2
    with pytest.raises(ConfigError, match="gsm8k_max_steps"):
        GRPOConfig(task="gsm8k", gsm8k_max_steps=-1)


def test_the_stage_trains_on_the_bound_and_the_whole_test_set_stays_unbounded(gsm8k_dir, monkeypatch):
    from grpo_core.pipeline.steps import dataset_identities

    monkeypatch.setenv("GSM8K_DIR", str(gsm8k_dir))
    cfg = PipelineConfig.from_dict({"curriculum": {"arithmetic_max": 30}, "gsm8k": {"gsm8k_max_steps": 2},
                                    "evaluate": {"gsm8k": {"max_difficulty": 2}, "sampled_sets": ["gsm8k_test_le2"]}})
    found = dataset_identities(cfg)
    assert found["gsm8k_train"]["params"]["gsm8k_max_steps"] == 2
    assert found["gsm8k_test"]["params"]["gsm8k_max_steps"] == 0
    assert found["gsm8k_test_le2"]["params"]["gsm8k_max_steps"] == 2
    assert cfg.eval_set_names() == ["arithmetic_test", "gsm8k_test", "gsm8k_test_le2"]
    sets = eval_sets(cfg.evaluate, {n: found[n]["params"] for n in cfg.eval_set_names()})
    assert {r["steps"] for r in sets["gsm8k_test_le2"]} == {0, 1, 2}
    assert max(r["steps"] for r in sets["gsm8k_test"]) == 6


def test_sampled_sets_must_be_evaluated():
    with pytest.raises(ConfigError, match="evaluate.sampled_sets"):
        PipelineConfig.from_dict({"evaluate": {"sampled_sets": ["gsm8k_test_le2"]}})  # no bound: no such set


def test_the_summary_reports_accuracy_by_steps_buckets():
    results = [{"item_id": i, "correct": c, "steps": s}
               for i, (c, s) in enumerate([(True, 0), (False, 2), (True, 3), (False, 3), (True, 5), (True, 8)])]
    by = summarize(results)["by_steps"]
    assert by == {"<=2": {"accuracy": 0.5, "n": 2}, "3": {"accuracy": 0.5, "n": 2}, "5+": {"accuracy": 1.0, "n": 2}}
    assert "by_steps" not in summarize([{"item_id": 0, "correct": True}])


def test_bounded_sets_get_their_size_and_the_gsm8k_cap():
    e = EvalConfig.from_table({"max_new_tokens": 128,
                               "gsm8k": {"max_difficulty": 2, "bounded_size": 300, "max_new_tokens": 256}})
    assert e.size("gsm8k_test_le2") == 300 and e.budget("gsm8k_test_le2") == 256
    assert e.budget("arithmetic_test") == 128
