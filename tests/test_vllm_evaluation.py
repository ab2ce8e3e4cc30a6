"""The flow's evaluation step on ``evaluate.engine = "vllm"``: a real vLLM server (from the venv
infra/vllm-env.sh builds) decodes every set, gives the in-process decoder's greedy answers item for
item, and is stopped when the evaluation ends."""
import pytest

from grpo_core.config.pipeline import PipelineConfig
from grpo_core.data import tasks
from grpo_core.pipeline.evaluation_step import _evaluate
from grpo_core.rollout import vllm_server
from grpo_core.rollout.vllm_engine import VllmEngine
from tests.helpers import off_init_tiny_dir


def config(engine: str) -> PipelineConfig:
    return PipelineConfig.from_dict({
        "evaluate": {"engine": engine, "vllm": {"kv_cache_memory_bytes": 64 << 20}, "max_new_tokens": 10,
                     "batch_size": 4, "sampled_sets": ["arithmetic_test"], "sampled_k": 2, "sampled_size": 3,
                     "sampled_temperature": 0.9, "max_prompt_tokens": 128,
                     "arithmetic": {"size": 8}, "gsm8k": {"size": -1}},
        "register": {"primary": "arithmetic_test"}})


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return off_init_tiny_dir(tmp_path_factory.mktemp("model"), seed=4)


def test_the_evaluation_on_vllm_gives_the_in_process_greedy_answers_and_stops_its_server(model_dir, monkeypatch):
    starts, syncs = [], []
    real_start, real_sync = vllm_server.VllmServer.start, VllmEngine.sync_weights
    monkeypatch.setattr(vllm_server.VllmServer, "start", lambda self: (real_start(self), starts.append(self.proc))[0])
    monkeypatch.setattr(VllmEngine, "sync_weights", lambda self, model: (syncs.append(1), real_sync(self, model))[1])
    cfg = config("vllm")
    params = tasks.task("arithmetic").params_of(cfg.stage("curriculum", model="-"))
    datasets = {"arithmetic_test": {"params": params}}
    served = _evaluate(cfg, "curriculum", model_dir, datasets)
    assert len(starts) == 1 and starts[0].poll() is not None  # one server for the whole evaluation, gone after it
    assert len(syncs) == 1  # the weights went once, for the greedy and the sampled sets
    local = _evaluate(config("auto"), "curriculum", model_dir, datasets)
    assert served["engine"] == "vllm" and local["engine"] == "auto"
    got, want = served["items"]["arithmetic_test"], local["items"]["arithmetic_test"]
    assert len(got) == 8 and [r["item_id"] for r in got] == [r["item_id"] for r in want]
    assert [r["completion"] for r in got] == [r["completion"] for r in want]
    assert [(r["capped"], r["looped"]) for r in got] == [(r["capped"], r["looped"]) for r in want]
    sampled = served["sampled"]["arithmetic_test"]
    assert [r["item_id"] for r in sampled] == [r["item_id"] for r in want[:3]] and all(r["k"] == 2 for r in sampled)
    again = _evaluate(cfg, "curriculum", model_dir, datasets)["sampled"]["arithmetic_test"]
    assert again == sampled  # seeded: every model draws from the same stream, on vLLM too


def test_an_evaluation_that_fails_stops_its_server(model_dir, monkeypatch):
    import dataclasses

    def grade_fails(text, gold):
        raise RuntimeError("grader broke")

    starts = []
    real_start = vllm_server.VllmServer.start
    monkeypatch.setattr(vllm_server.VllmServer, "start", lambda self: (real_start(self), starts.append(self.proc))[0])
    task = tasks.task("arithmetic")
    monkeypatch.setattr(tasks, "split_of",
                        lambda name: (dataclasses.replace(task, grade=grade_fails), "test"))
    cfg = config("vllm")
    params = task.params_of(cfg.stage("curriculum", model="-"))
    with pytest.raises(RuntimeError, match="grader broke"):
        _evaluate(cfg, "curriculum", model_dir, {"arithmetic_test": {"params": params}})
    assert len(starts) == 1 and starts[0].poll() is not None
