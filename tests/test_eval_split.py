"""One checkpoint's evaluation split over local worker processes (``grpo_core/evaluation/job.py``):
the parts come back in item order, each worker's answers are what its share gives in this process,
a failing worker fails the evaluation by name, and the config refuses what cannot be split."""
import random

import pytest
import torch

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.data import tasks
from grpo_core.evaluation import job as eval_job
from grpo_core.evaluation.greedy import held_out_items
from grpo_core.pipeline.evaluation_step import _evaluate
from tests.helpers import off_init_tiny_dir


def config(workers: int, **evaluate) -> PipelineConfig:
    return PipelineConfig.from_dict({
        "evaluate": {"workers": workers, "max_new_tokens": 12, "batch_size": 4, "sampled_sets": ["arithmetic_test"],
                     "sampled_k": 3, "sampled_size": 5, "sampled_temperature": 1.0, "max_prompt_tokens": 128,
                     "arithmetic": {"size": 11}, "gsm8k": {"size": -1}, **evaluate},
        "register": {"primary": "arithmetic_test"}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return off_init_tiny_dir(tmp_path_factory.mktemp("model"), seed=5)


def datasets(cfg: PipelineConfig) -> dict:
    return {"arithmetic_test": {"params": tasks.task("arithmetic").params_of(cfg.stage("curriculum", model="-"))}}


@pytest.mark.parametrize("n, parts", [(11, 2), (11, 3), (2, 3), (0, 2), (7, 1)])
def test_interleave_undoes_the_strided_split(n, parts):
    rows = [random.Random(n).random() for _ in range(n)]
    assert eval_job.interleave([rows[i::parts] for i in range(parts)], n) == rows


def test_interleave_refuses_parts_that_do_not_make_the_set():
    with pytest.raises(ValueError, match="the parts hold 3 items, the set 4"):
        eval_job.interleave([[1, 2], [3]], 4)


def overlapping_job(**evaluate) -> eval_job.EvalJob:
    """GSM8K-shaped sets that share rows: gsm8k_test holds a..d, gsm8k_test_le2 holds b, d, e
    (prompts of different lengths); the first two of gsm8k_test_le2 are also sampled."""
    row = lambda name, prompt: {"id": f"gsm8k_test:{name}", "prompt": prompt, "gold": "1", "steps": 1}  # noqa: E731
    a, b, c, d, e = (row("a", "x" * 50), row("b", "x" * 10), row("c", "x" * 30), row("d", "x" * 20), row("e", "x" * 5))
    cfg = config(2, **{"gsm8k": {"max_new_tokens": 256}, **evaluate})
    return eval_job.EvalJob(model_uri="-", evaluate=cfg.evaluate, sets={"gsm8k_test": [a, b, c, d],
                            "gsm8k_test_le2": [b, d, e]}, sampled={"gsm8k_test_le2": [b, d]},
                            temperatures={"gsm8k_test_le2": 1.0})


def test_sets_that_share_rows_decode_each_row_once_shortest_prompt_first():
    streams = eval_job.streams(overlapping_job())
    assert list(streams) == ["greedy:gsm8k@256", "sampled:gsm8k_test_le2"]
    greedy = streams["greedy:gsm8k@256"]
    assert [r["id"][-1] for r in greedy.rows] == ["e", "b", "d", "c", "a"] and greedy.k == 0
    sampled = streams["sampled:gsm8k_test_le2"]
    assert [r["id"][-1] for r in sampled.rows] == ["b", "d"] and (sampled.k, sampled.temperature) == (3, 1.0)


def test_a_stream_is_named_by_its_task_and_cap_and_tasks_are_decoded_apart():
    streams = eval_job.streams(overlapping_job(gsm8k={"max_new_tokens": 64}))
    assert "greedy:gsm8k@64" in streams
    job = overlapping_job()
    job.sets["arithmetic_test"] = [{"id": "arith:1+1", "prompt": "What is 1 + 1?", "gold": "2"}]
    assert [k for k in eval_job.streams(job) if k.startswith("greedy")] == ["greedy:gsm8k@256", "greedy:arithmetic@12"]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_merge_gives_every_set_its_rows_results_in_item_order(workers):
    job = overlapping_job()
    streams = eval_job.streams(job)
    parts = [{key: [{"item_id": r["id"], "shard": i} for r in s.rows[i::workers]] for key, s in streams.items()}
             for i in range(workers)]
    out = eval_job.merge(job, parts)
    assert {name: [r["item_id"][-1] for r in res] for name, res in out["items"].items()} == \
        {"gsm8k_test": ["a", "b", "c", "d"], "gsm8k_test_le2": ["b", "d", "e"]}
    shared = {r["item_id"]: r["shard"] for r in out["items"]["gsm8k_test"]}
    assert all(shared.get(r["item_id"], r["shard"]) == r["shard"] for r in out["items"]["gsm8k_test_le2"])
    assert [r["item_id"][-1] for r in out["sampled"]["gsm8k_test_le2"]] == ["b", "d"]
    out["items"]["gsm8k_test"][1]["changed"] = True          # each set holds its own copy
    assert "changed" not in out["items"]["gsm8k_test_le2"][0]
    parts[0]["greedy:gsm8k@256"].reverse()                    # a part from another plan is refused
    with pytest.raises(ValueError, match="do not follow this job's plan"):
        eval_job.merge(job, parts)


def test_rows_two_sets_share_come_back_the_same_through_the_workers(model_dir):
    cfg = config(2)
    rows = held_out_items(tasks.task("arithmetic"), datasets(cfg)["arithmetic_test"]["params"], 10)
    job = eval_job.EvalJob(model_uri=model_dir, evaluate=cfg.evaluate,
                           sets={"arithmetic_test": rows[:8], "arithmetic_validation": rows[3:10]}, label="shared")
    split = eval_job.run_split(job, 2, threads=1)
    got = {name: [(r["item_id"], r["completion"]) for r in res] for name, res in split["items"].items()}
    assert [i for i, _ in got["arithmetic_test"]] == [r["id"] for r in rows[:8]]
    assert [i for i, _ in got["arithmetic_validation"]] == [r["id"] for r in rows[3:10]]
    assert got["arithmetic_test"][3:] == got["arithmetic_validation"][:5]
    here = eval_job.merge(job, [eval_job.run(job)])
    assert {name: [(r["item_id"], r["completion"]) for r in res] for name, res in here["items"].items()} == got


def test_two_workers_give_each_shards_in_process_answers_in_item_order(model_dir):
    cfg = config(2)
    split = _evaluate(cfg, "curriculum", model_dir, datasets(cfg))
    assert split["workers"] == 2
    got = split["items"]["arithmetic_test"]
    rows = held_out_items(tasks.task("arithmetic"), datasets(cfg)["arithmetic_test"]["params"], 11)
    assert [r["item_id"] for r in got] == [r["id"] for r in rows]
    assert [r["item_id"] for r in split["sampled"]["arithmetic_test"]] == [r["id"] for r in rows[:5]]
    # the same shares decoded here, one thread as each worker had: the same answers and samples
    job = eval_job.EvalJob(model_uri=model_dir, evaluate=cfg.evaluate, sets={"arithmetic_test": rows},
                           sampled={"arithmetic_test": rows[:5]}, temperatures={"arithmetic_test": 1.0},
                           label="curriculum")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        here = eval_job.merge(job, [eval_job.run(job, i, 2) for i in range(2)])
    finally:
        torch.set_num_threads(threads)
    assert [r["completion"] for r in got] == [r["completion"] for r in here["items"]["arithmetic_test"]]
    assert split["sampled"]["arithmetic_test"] == here["sampled"]["arithmetic_test"]
    one = _evaluate(config(1), "curriculum", model_dir, datasets(cfg))
    assert one["workers"] == 1 and [r["item_id"] for r in one["items"]["arithmetic_test"]] == [r["id"] for r in rows]
    assert [r["completion"] for r in one["items"]["arithmetic_test"]] == [r["completion"] for r in got]
    assert split["summary"]["arithmetic_test"]["n"] == 11 and split["sampled_summary"]["arithmetic_test"]["k"] == 3


def test_a_failing_worker_fails_the_evaluation_and_names_itself(tmp_path):
    cfg = config(2)
    with pytest.raises(RuntimeError, match=r"worker [01] of 2 exited with \d+"):
        _evaluate(cfg, "curriculum", str(tmp_path / "no-such-model"), datasets(cfg))


def slow_job(model_dir: str, cfg: PipelineConfig, n: int = 1000) -> eval_job.EvalJob:
    """``n`` arithmetic items (the test split's, repeated under new ids) at a 48-token cap, in
    batches of 4: tens of seconds of decoding per worker."""
    import dataclasses

    test = held_out_items(tasks.task("arithmetic"), datasets(cfg)["arithmetic_test"]["params"], None)
    rows = [{**test[i % len(test)], "id": f"{test[i % len(test)]['id']}#{i}"} for i in range(n)]
    e = dataclasses.replace(cfg.evaluate, max_new_tokens=48)
    e.tasks["arithmetic"] = dataclasses.replace(e.tasks["arithmetic"], max_new_tokens=48)
    return eval_job.EvalJob(model_uri=model_dir, evaluate=e, sets={"arithmetic_test": rows}, label="slow")


def recording_popen(monkeypatch) -> list:
    started, real = [], eval_job.subprocess.Popen
    monkeypatch.setattr(eval_job.subprocess, "Popen", lambda *a, **k: started.append(real(*a, **k)) or started[-1])
    return started


def test_when_one_worker_fails_the_other_is_stopped_not_left_decoding(model_dir, monkeypatch):
    cfg = config(2)
    job = slow_job(model_dir, cfg)
    bad = eval_job.streams(job)["greedy:arithmetic@48"].rows[1]["id"]  # worker 1's first row: it fails grading it
    job.sets["arithmetic_test"] = [{k: v for k, v in r.items() if k != "gold" or r["id"] != bad}
                                   for r in job.sets["arithmetic_test"]]
    started = recording_popen(monkeypatch)
    with pytest.raises(RuntimeError, match="worker 1 of 2 exited with 1"):
        eval_job.run_split(job, 2, threads=1)
    assert len(started) == 2 and started[1].returncode == 1
    assert started[0].returncode == -15  # stopped by SIGTERM while still decoding its 500 items


def test_workers_end_when_the_evaluating_process_is_killed_outright(model_dir, tmp_path):
    """SIGKILL of the process that split the evaluation (as Metaflow kills a sibling task) runs
    no cleanup; the workers end anyway (``die_with_parent``)."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    cfg = config(2)
    (tmp_path / "job.json").write_text(slow_job(model_dir, cfg, n=4000).to_json())
    script = ("import sys; from pathlib import Path; from grpo_core.evaluation import job as j; "
              "j.run_split(j.EvalJob.from_json(Path(sys.argv[1]).read_text()), 2, threads=1)")
    parent = subprocess.Popen([sys.executable, "-c", script, str(tmp_path / "job.json")])
    workers = []
    try:
        deadline = time.time() + 60
        while len(workers := psutil.Process(parent.pid).children()) < 2 and time.time() < deadline:
            time.sleep(0.2)
        assert len(workers) == 2, "the workers did not start"
        time.sleep(3)  # past their start-up: the parent-death signal is set by now
        assert all(w.is_running() for w in workers), json.dumps([w.pid for w in workers])
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        gone, alive = psutil.wait_procs(workers, timeout=30)
        assert not alive, f"workers outlived their killed parent: {[w.pid for w in alive]}"
    finally:  # only this test's processes: the session's servers are children of pytest too
        if parent.poll() is None:
            parent.kill()
        for w in workers:
            if w.is_running():
                w.kill()


def test_the_config_refuses_a_split_it_cannot_run():
    with pytest.raises(ConfigError, match="evaluate.workers: must be an integer >= 1"):
        config(0)
    with pytest.raises(ConfigError, match="evaluate.workers: .*set workers = 1"):
        config(2, engine="vllm")
