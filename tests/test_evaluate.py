"""Evaluation records: truncation share, the pairing with the start model, the summary table."""
import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.evaluation import EvalConfig
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.evaluation.greedy import compare_to_start, summarize
from grpo_core.evaluation.sampled import summarize_sampled
from grpo_core.pipeline.evaluation_step import paired_with_start, summary_table


def _items(correct, truncated=None):
    truncated = truncated or [False] * len(correct)
    return [{"item_id": f"i{k}", "correct": c, "gold": "1", "completion": "", "truncated": t}
            for k, (c, t) in enumerate(zip(correct, truncated))]


def test_summary_counts_answers_cut_by_the_generation_cap():
    s = summarize(_items([True, False, True, False], [False, True, True, False]))
    assert (s["accuracy"], s["correct"], s["n"], s["truncated_frac"]) == (0.5, 2, 4, 0.5)


def test_comparison_with_the_start_model_is_paired_by_item():
    # start right on i0,i1; later right on i1..i9: 8 gained, 1 lost -> two-sided binomial(9, 1/2)
    start = _items([True, True] + [False] * 8)
    later = list(reversed(_items([False] + [True] * 9)))  # order must not matter, ids pair them
    got = compare_to_start(start, later)
    assert (got["gained"], got["lost"]) == (8, 1)
    assert got["delta"] == pytest.approx((9 - 2) / 10)
    assert got["p_value"] == pytest.approx(2 * (1 + 9) / 2**9)  # P(X <= 1) twice: (C(9,0)+C(9,1)) / 2^9


def test_comparison_refuses_different_items():
    with pytest.raises(ValueError, match="1 items are in only one"):
        compare_to_start(_items([True, False]), _items([True, False, True]))


def test_stage_table_pairs_every_stage_with_the_start_row():
    def result(stage, correct, cut):
        items = {"arithmetic_test": _items(correct, cut)}
        return {"stage": stage, "items": items, "summary": {"arithmetic_test": summarize(items["arithmetic_test"])}}

    results = paired_with_start([result("sft", [True] + [False] * 9, [True] + [False] * 9),
                                 result("curriculum", [True] * 9 + [False], [False] * 10),
                                 result("gsm8k", [True] * 8 + [False] * 2, [False] * 10)])
    # gsm8k against the curriculum: 1 lost, 0 gained -> p = 1; against the start: 7 gained
    assert results[2]["vs_previous"]["arithmetic_test"] == {"delta": pytest.approx(-0.1), "p_value": 1.0,
                                                          "gained": 0, "lost": 1, "stage": "curriculum"}
    assert results[2]["vs_start"]["arithmetic_test"]["gained"] == 7
    assert "vs_start" not in results[0]
    assert results[1]["vs_start"]["arithmetic_test"]["gained"] == 8
    stage = {"iterations_run": 3, "last": {"informative_frac": 0.5}}
    table = summary_table(results, {"curriculum": stage, "gsm8k": stage},
                          {"model_name": "m", "version": 1, "decision": "first"})
    start_line = next(ln for ln in table.splitlines() if ln.strip().startswith("sft"))
    cur_line = next(ln for ln in table.splitlines() if ln.strip().startswith("curriculum "))
    assert "10.0%" in start_line and "-" in start_line
    assert "+0.800" in cur_line and "0.0078" in cur_line  # 8 gained, 0 lost: 2 / 2^8
    assert results[1]["vs_previous"]["arithmetic_test"]["stage"] == "sft"
    one = {"iterations_run": 1, "last": {}, "reward_trend": {"first": 0.0, "last": 0.0, "window": 1, "diff": 0.0,
                                                            "ci_low": float("nan"), "ci_high": float("nan")}}
    table = summary_table(results, {"curriculum": stage, "gsm8k": one},
                          {"model_name": "m", "version": 1, "decision": "promoted", "p_value": 2.977e-14,
                           "compared_items": 10})
    assert "nan" not in table and "too few iterations for an interval" in table
    assert "promoted (p=3e-14, 10 items)" in table


def test_each_task_gets_its_own_generation_cap_and_size_from_its_table():
    e = EvalConfig.from_table({"max_new_tokens": 128, "gsm8k": {"max_new_tokens": 384, "size": 0}})
    assert (e.budget("arithmetic_test"), e.budget("gsm8k_test")) == (128, 384)
    assert (e.size("arithmetic_test"), e.size("gsm8k_test")) == (300, None)  # arithmetic's default; 0 = all
    assert EvalConfig(max_new_tokens=96).budget("gsm8k_test") == 96
    assert EvalConfig().size("gsm8k_test") == 100  # GSM8K's own default (Task.eval_defaults)


def test_the_evaluate_table_round_trips_through_to_dict():
    pc = PipelineConfig.from_dict({"evaluate": {"engine": "generate", "vllm": {"port": 8123},
                                                "gsm8k": {"max_difficulty": 3, "bounded_size": 7}}})
    again = PipelineConfig.from_dict(pc.to_dict())
    assert again.to_dict() == pc.to_dict() and again.evaluate.engine == "generate" and again.evaluate.vllm.port == 8123
    assert again.eval_set_names() == ["arithmetic_test", "gsm8k_test", "gsm8k_test_le3"]
    assert again.evaluate.size("gsm8k_test_le3") == 7


def test_replacing_an_evaluate_field_keeps_the_task_tables():
    import dataclasses
    e = EvalConfig.from_table({"gsm8k": {"size": 7, "max_difficulty": 2}})
    changed = dataclasses.replace(e, batch_size=8)
    assert changed.set_names(["gsm8k"]) == ["gsm8k_test", "gsm8k_test_le2"] and changed.size("gsm8k_test") == 7
    with pytest.raises(ConfigError, match=r"evaluate\.gsm8k\.size: must be >= -1"):
        dataclasses.replace(e, tasks={"gsm8k": {"size": -3}})


def test_the_cli_evaluates_any_registered_task_with_its_params(tiny, capsys):
    """`python -m grpo_core.evaluation`: --set choices and the data flags come from the task registry."""
    import json

    from grpo_core.data import tasks
    from grpo_core.evaluation.greedy import main

    main(["--model", str(tiny), "--set", "arithmetic_test", "--size", "7", "--max-new-tokens", "6",
          "--arithmetic-max", "30"])
    out = json.loads(capsys.readouterr().out)
    assert out["set"] == "arithmetic_test" and out["n"] == 7
    assert {"accuracy", "truncated_frac", "looped_frac"} <= set(out)
    params = {"arithmetic_ops": "+-*", "arithmetic_min": 0, "arithmetic_max": 30}
    assert out["data"] == tasks.task("arithmetic").identity("test", **params)["source"]
    with pytest.raises(SystemExit):
        main(["--model", str(tiny), "--set", "nonexistent_test"])
    assert "gsm8k_test" in capsys.readouterr().err  # the choices named come from tasks.registry()


def test_the_registered_version_says_what_it_beat_by_how_much_on_which_items():
    from grpo_core.pipeline.steps import version_description

    def result(stage, right):
        it = {"gsm8k_test_le2": [{"item_id": i, "correct": i < right} for i in range(10)]}
        sampled = {"gsm8k_test_le2": [{"item_id": i, "k": 2, "correct_k": int(i < right)} for i in range(10)]}
        return {"stage": stage, "items": it, "sampled": sampled,
                "summary": {k: summarize(v) for k, v in it.items()},
                "sampled_summary": {k: summarize_sampled(v) for k, v in sampled.items()}}

    start, final = paired_with_start([result("sft", 1), result("gsm8k", 6)])
    decision = {"decision": "promoted", "eval_set": "gsm8k_test_le2", "compared_items": 10, "reason": "p=0.06"}
    line = version_description(decision, final, start)
    assert "\n" not in line and line.startswith("promoted on gsm8k_test_le2 (10 items; p=0.06)")
    assert "gsm8k_test_le2 greedy 0.100 -> 0.600 (p=0.062, 10 items)" in line
    assert "gsm8k_test_le2 mean@2 0.050 -> 0.300 (p=0.062, 10 items)" in line
    assert version_description(decision, {"items": {}}, None) == "promoted on gsm8k_test_le2 (10 items; p=0.06)"
