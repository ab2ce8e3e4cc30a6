"""Registry: versions, paired promotion against the champion, aliases, loading, the compare CLI.

Uses a tiny Llama built locally (no downloads) and synthetic per-item results, against sqlite
and against a real MLflow server whose artifacts go to S3 (moto).
"""

from __future__ import annotations

import pytest

from grpo_core.tracking.registry import aliases_by_version, decide_promotion, main, register_model
from grpo_core.tracking.runs import mlflow_client, start_parent_run
from grpo_core.tracking.served_model import load_model

pytestmark = pytest.mark.usefixtures("no_cwd_writes")  # MLflow must never fall back to the cwd

N = 60  # items per eval set


def items(n_right: int, n: int = N, prefix: str = "gsm8k") -> list[dict]:
    """The first n_right items are correct: models with more right items dominate the others."""
    return [{"item_id": f"{prefix}-{i:03d}", "correct": i < n_right} for i in range(n)]


def evals(n_right: int) -> dict[str, list[dict]]:
    return {"gsm8k_test": items(n_right), "arithmetic_test": items(min(N, n_right + 5), prefix="arith")}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A 1-layer Llama with a character-level tokenizer, saved the way the trainer saves it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for ch in "0123456789+-*/=() abcdefghijklmnopqrstuvwxyz?.,:":
        vocab.setdefault(ch, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")  # one token per character
    tok.decoder = decoders.Fuse()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                     unk_token="<unk>")
    cfg = LlamaConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64,
                      vocab_size=64, pad_token_id=0, eos_token_id=1, bos_token_id=1)
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    hf_tok.save_pretrained(out)
    return str(out)


def _register(uri, model_dir, n_right, rule="significant", name="grpo-test", run_id=None, digest="gsm8k-test-v1",
              **kw):
    run_id = run_id or start_parent_run(uri, "grpo-registry", {"metaflow.pathspec": f"GrpoFlow/{n_right}"})
    tags = {"dataset.gsm8k_test.digest": digest, "metaflow.pathspec": f"GrpoFlow/{n_right}",
            "config": "local", "s3_uri": "s3://user:pw@bucket/x"}
    return register_model(uri, run_id, model_dir, name, eval_items=evals(n_right), tags=tags, rule=rule, **kw)


def _load_and_predict(uri, name):
    return load_model(uri, name, max_new_tokens=4).predict(["12+3="])


# ---------------------------------------------------------------- pure decision


def test_decide_promotion_rules():
    champ, better, slightly = items(10), items(40), items(11)
    assert decide_promotion(better, None)["decision"] == "first"
    r = decide_promotion(better, champ)
    # 30 discordant items, all for the new model: p = 2 * 0.5**30
    assert r["decision"] == "promoted" and r["p_value"] == pytest.approx(2 * 0.5**30)
    assert (r["challenger_accuracy"], r["champion_accuracy"], r["compared_items"]) == (40 / 60, 10 / 60, 60)
    assert decide_promotion(slightly, champ)["decision"] == "challenger"  # p = 1.0
    assert decide_promotion(slightly, champ, rule="better")["decision"] == "promoted"
    assert decide_promotion(champ, champ, rule="better")["decision"] == "challenger"  # ties stay
    assert decide_promotion(items(5), champ, rule="always")["decision"] == "promoted"
    disjoint = decide_promotion(better, items(10, prefix="other"))
    assert disjoint["decision"] == "challenger" and disjoint["compared_items"] == 0
    assert "no item ids in common" in disjoint["reason"]
    half = decide_promotion(better, champ[:30])  # only the shared items count
    assert half["compared_items"] == 30 and half["challenger_accuracy"] == 1.0
    with pytest.raises(ValueError):
        decide_promotion(better, champ, rule="vibes")


# ---------------------------------------------------------------- sqlite: the whole alias story


def test_registry_flow_sqlite(sqlite_uri, model_dir, capsys):
    from mlflow import MlflowClient

    uri, name = sqlite_uri, "grpo-test"
    assert _register(uri, model_dir, 20)["decision"] == "first"  # v1
    assert _register(uri, model_dir, 15)["decision"] == "challenger"  # v2: worse
    v3 = _register(uri, model_dir, 50)  # much better: 30 discordant, all for v3
    assert v3["decision"] == "promoted" and v3["p_value"] < 0.05 and v3["compared_items"] == N
    v4 = _register(uri, model_dir, 51)  # one more item right: not significant
    assert v4["decision"] == "challenger" and v4["p_value"] == 1.0
    v5 = _register(uri, model_dir, 51, rule="better")
    assert v5["decision"] == "promoted" and v5["version"] == 5

    client = MlflowClient(tracking_uri=uri, registry_uri=uri)
    assert aliases_by_version(client, name) == {
        5: ["champion"], 3: ["previous-champion"], 4: ["challenger"]}
    mv = client.get_model_version(name, "5")
    assert mv.tags["eval.gsm8k_test.accuracy"] == str(51 / 60)
    assert float(mv.tags["eval.gsm8k_test.ci_low"]) < 51 / 60 < float(mv.tags["eval.gsm8k_test.ci_high"])
    assert mv.tags["decision"] == "promoted" and mv.tags["compared_items"] == "60"
    assert mv.tags["eval_set"] == "gsm8k_test" and v5["eval_set"] == "gsm8k_test"  # what the p-value is about
    assert mv.tags["dataset.gsm8k_test.digest"] == "gsm8k-test-v1" and "pw" not in mv.tags["s3_uri"]
    run = client.get_run(mv.run_id)
    assert run.data.tags["promotion.decision"] == "promoted" and run.data.tags["promotion.eval_set"] == "gsm8k_test"
    assert run.data.metrics["promotion.challenger_accuracy"] == pytest.approx(51 / 60)
    assert {a.path for a in client.list_artifacts(mv.run_id, "eval")} == {
        "eval/items_gsm8k_test.json", "eval/items_arithmetic_test.json"}

    again = _register(uri, model_dir, 51, rule="better", run_id=mv.run_id)  # a resumed register step
    assert again["version"] == 5 and len(client.search_model_versions(f"name='{name}'")) == 5
    for key in ("promotion.challenger_accuracy", "eval.gsm8k_test.accuracy"):  # each logged once
        assert len(client.get_metric_history(mv.run_id, key)) == 1, key
    assert aliases_by_version(client, name)[5] == ["champion"]

    # replaying v3's register step (promoted over v1, at the time) must not take champion back from v5
    v3_run = client.get_model_version(name, "3").run_id
    assert _register(uri, model_dir, 50, run_id=v3_run)["version"] == 3
    assert aliases_by_version(client, name)[5] == ["champion"]

    out = _load_and_predict(uri, name)
    assert isinstance(out, list) and len(out) == 1 and isinstance(out[0], str)

    capsys.readouterr()
    assert main(["compare", name, "--tracking-uri", uri]) == 0
    table = capsys.readouterr().out
    for text in ("champion", "previous-champion", "challenger", "0.850 [", "gsm8k-test-v1"[:12], "GrpoFlow/51"):
        assert text in table
    assert len(table.strip().splitlines()) == 6  # header + 5 versions
    main(["compare", name, "--a", "3", "--b", "1", "--set", "gsm8k_test", "--tracking-uri", uri])
    pair = capsys.readouterr().out
    assert "a_only=30  b_only=0  both=20  neither=10" in pair and "McNemar exact p=1.863e-09" in pair
    assert pair.count("v3=right  v1=wrong") == 20 and "... 10 more differing items" in pair


def test_a_champion_evaluated_on_other_data_is_not_compared(sqlite_uri, model_dir):
    """Item ids are positions in the split: against a champion whose test data had another digest,
    the same ids name other questions, so nothing is compared and nothing is promoted."""
    name = "grpo-other-data"
    assert _register(sqlite_uri, model_dir, 10, name=name, digest="old-revision")["decision"] == "first"
    r = _register(sqlite_uri, model_dir, 50, name=name, digest="new-revision")
    assert r["decision"] == "challenger" and r["compared_items"] == 0 and "other gsm8k_test data" in r["reason"]
    assert _register(sqlite_uri, model_dir, 50, name=name, digest="old-revision")["decision"] == "promoted"


def test_a_registration_landing_mid_decision_is_decided_against(sqlite_uri, model_dir, monkeypatch):
    """v3 (much better) is registered and promoted while v2 (worse than v3, better than v1) is
    being decided against v1: v2 decides again against v3 and stays challenger, so the best
    model keeps @champion (it used to end with v2 champion and v3 with no alias)."""
    from mlflow import MlflowClient

    import grpo_core.tracking.registry as registry

    name = "grpo-race"
    assert _register(sqlite_uri, model_dir, 10, name=name)["decision"] == "first"
    decide, landed = registry._decide_against_champion, []

    def decide_while_another_registers(*args, **kw):
        result = decide(*args, **kw)
        if not landed:  # once: the other registration decides unhindered
            landed.append(None)
            landed[0] = _register(sqlite_uri, model_dir, 55, name=name)
        return result

    monkeypatch.setattr(registry, "_decide_against_champion", decide_while_another_registers)
    v2 = _register(sqlite_uri, model_dir, 30, name=name)
    assert landed[0]["decision"] == "promoted" and landed[0]["version"] == 3
    assert v2["version"] == 2 and v2["decision"] == "challenger" and v2["champion_version"] == 3
    client = MlflowClient(tracking_uri=sqlite_uri, registry_uri=sqlite_uri)
    assert aliases_by_version(client, name) == {3: ["champion"], 1: ["previous-champion"], 2: ["challenger"]}


def test_a_champion_that_keeps_moving_leaves_the_version_challenger(sqlite_uri, model_dir, monkeypatch):
    """A better model lands during each of the MAX_DECISIONS decisions: the version was never
    compared with the champion it would replace, so it stays challenger instead of taking
    @champion on a stale comparison."""
    from mlflow import MlflowClient

    import grpo_core.tracking.registry as registry

    name = "grpo-race-busy"
    assert _register(sqlite_uri, model_dir, 10, name=name)["decision"] == "first"
    decide, landed, busy = registry._decide_against_champion, [], []

    def decide_while_others_register(*args, **kw):
        result = decide(*args, **kw)
        if not busy:  # the outer registration only; the landing ones decide unhindered
            busy.append(None)
            landed.append(_register(sqlite_uri, model_dir, 40 + 10 * len(landed), name=name))
            busy.pop()
        return result

    monkeypatch.setattr(registry, "_decide_against_champion", decide_while_others_register)
    v2 = _register(sqlite_uri, model_dir, 30, name=name)
    assert [r["decision"] for r in landed] == ["promoted"] * registry.MAX_DECISIONS
    assert v2["decision"] == "challenger" and "moved during each of 3 decisions" in v2["reason"]
    client = MlflowClient(tracking_uri=sqlite_uri, registry_uri=sqlite_uri)
    assert aliases_by_version(client, name)[landed[-1]["version"]] == ["champion"]
    assert aliases_by_version(client, name)[v2["version"]] == ["challenger"]


# ---------------------------------------------------------------- real server, artifacts in S3


def test_registry_on_server_with_s3_artifacts(mlflow_servers, s3_env, model_dir):
    import boto3
    from mlflow import MlflowClient

    s3 = boto3.client("s3", endpoint_url=s3_env["MLFLOW_S3_ENDPOINT_URL"])
    s3.create_bucket(Bucket="grpo-mlflow")
    srv = mlflow_servers(artifacts="s3://grpo-mlflow/proxied", env=s3_env)
    name = "grpo-s3"
    assert _register(srv.url, model_dir, 20, name=name)["decision"] == "first"
    r = _register(srv.url, model_dir, 50, name=name)
    assert r["decision"] == "promoted" and r["version"] == 2  # int, although REST returns str

    client = MlflowClient(tracking_uri=srv.url, registry_uri=srv.url)
    assert aliases_by_version(client, name) == {2: ["champion"], 1: ["previous-champion"]}
    assert len(_load_and_predict(srv.url, name)) == 1

    keys = [o["Key"] for page in s3.get_paginator("list_objects_v2").paginate(
        Bucket="grpo-mlflow", Prefix="proxied/") for o in page.get("Contents", [])]
    assert any("/models/m-" in k and k.endswith("/model.safetensors") for k in keys), keys
    assert sum(k.endswith("eval/items_gsm8k_test.json") for k in keys) == 2


def test_registered_model_answers_as_the_evaluation_measured(sqlite_uri, model_dir, tmp_path):
    """The champion's pyfunc must reproduce the evaluated completions, or the registry's accuracy
    describes another model: same prompt format (here a chat template) and plain argmax, even
    when the checkpoint's generation_config carries logit processors."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_core.evaluation.greedy import greedy_results

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tok = AutoTokenizer.from_pretrained(model_dir)
    questions = ["12+3=", "what is 7 * 8?", "(4-1)*2="]
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights: argmax far from ties, answers differ per prompt
        for p in model.parameters():
            p.normal_(0, 0.3)
    tok.chat_template = "q: {{ messages[0]['content'] }} a:"
    rows = [{"id": q, "prompt": q, "gold": "0"} for q in questions]
    # a turn-end token the checkpoint lists beside the tokenizer's eos (as Llama-3-Instruct's
    # <|eot_id|>): the third character of the first greedy answer (one token per character)
    free = greedy_results(model, tok, rows[:1], max_new_tokens=8, batch_size=1)[0]["completion"]
    assert len(free) >= 4 and free[2] not in free[:2]
    turn_end = tok.convert_tokens_to_ids(free[2])
    assert turn_end != tok.unk_token_id
    model.generation_config.update(repetition_penalty=3.0, no_repeat_ngram_size=1,
                                   eos_token_id=[tok.eos_token_id, turn_end])
    checkpoint = tmp_path / "checkpoint"
    model.save_pretrained(checkpoint)
    tok.save_pretrained(checkpoint)

    # the evaluation's cap is registered with the model: served without an override, it answers alike
    assert _register(sqlite_uri, str(checkpoint), 30, name="grpo-render", max_new_tokens=8)["decision"] == "first"
    served = load_model(sqlite_uri, "grpo-render").predict(questions)
    evaluated = greedy_results(model, tok, rows, max_new_tokens=8, batch_size=1)
    assert served == [r["completion"] for r in evaluated]
    assert served[0] == free[:3]  # both stopped at (and kept, as they keep an eos) the turn-end token
    # the test can tell: the checkpoint's processors on the raw question answer differently
    naive = []
    for q in questions:
        enc = tok(q, return_tensors="pt")
        ids = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
        naive.append(tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    assert naive != served


def test_served_model_renders_the_stages_system_prompt(sqlite_uri, tmp_path):
    """A stage's system prompt travels with the registered model: the pyfunc answers exactly as the
    evaluation (and so the rollouts, which render through the same rule) did with that prompt, and
    differently from the same model without it."""
    import torch

    from grpo_core.evaluation.greedy import greedy_results
    from grpo_core.model.loading import build_tiny, load_policy, save_policy

    model, tok = build_tiny(hidden=32, layers=1, heads=2, seed=3)
    torch.manual_seed(1)
    with torch.no_grad():  # large random weights: argmax far from ties, answers depend on the prompt
        for p in model.parameters():
            p.normal_(0, 0.3)
    checkpoint = save_policy(model, tok, tmp_path / "checkpoint")
    model, tok = load_policy(str(checkpoint))
    questions = ["What is 3 + 4?", "What is 12 * 2?"]
    rows = [{"id": q, "prompt": q, "gold": "0"} for q in questions]
    system = "Reply with the number."
    decision = register_model(sqlite_uri, start_parent_run(sqlite_uri, "grpo-registry", {}), str(checkpoint),
                              "grpo-system", eval_items=evals(30), tags={}, rule="always", max_new_tokens=8,
                              system_prompt=system)
    assert decision["decision"] in ("first", "promoted")
    served = load_model(sqlite_uri, "grpo-system").predict(questions)
    with_system = [r["completion"] for r in greedy_results(model, tok, rows, max_new_tokens=8, system_prompt=system)]
    without = [r["completion"] for r in greedy_results(model, tok, rows, max_new_tokens=8)]
    assert served == with_system
    assert with_system != without  # the test can tell the prompts apart


@pytest.mark.parametrize("n_right,start_right,decision", [(45, 20, "promoted"), (22, 20, "challenger")])
def test_first_version_must_beat_the_start_model(sqlite_uri, model_dir, n_right, start_right, decision):
    """With no champion yet, the start model's results are the bar: the same paired test decides.
    45 vs 20 right (25 gained, 0 lost) is significant; 22 vs 20 is not, and no champion is set."""
    name = f"grpo-first-{n_right}"
    result = _register(sqlite_uri, model_dir, n_right, name=name, baseline_items=items(start_right))
    assert result["decision"] == decision and result["compared_items"] == N
    assert "against the start model" in result["reason"]
    aliases = aliases_by_version(mlflow_client(sqlite_uri), name)
    assert aliases == ({1: ["champion"]} if decision == "promoted" else {1: ["challenger"]})


def test_served_model_stops_a_looping_answer_where_the_evaluation_did(sqlite_uri, tmp_path):
    """An answer that repeats itself verbatim: the pyfunc stops it at the same token as the
    evaluation's decoder (loops.LoopRule, restated in the pyfunc's own code), not at its cap."""
    from grpo_core.evaluation.greedy import greedy_results
    from grpo_core.model.loading import load_policy, save_policy
    from tests.test_loops import _looping_model

    model, tok = _looping_model()
    checkpoint = save_policy(model, tok, tmp_path / "checkpoint")
    model, tok = load_policy(str(checkpoint))
    questions = ["What is 3 + 4?", "hello"]  # the second loops (tests/test_loops.py)
    rows = [{"id": q, "prompt": q, "gold": "0"} for q in questions]
    decision = register_model(sqlite_uri, start_parent_run(sqlite_uri, "grpo-registry", {}), str(checkpoint),
                              "grpo-loops", eval_items=evals(30), tags={}, rule="always", max_new_tokens=160)
    assert decision["decision"] in ("first", "promoted")
    served = load_model(sqlite_uri, "grpo-loops").predict(questions)
    evaluated = greedy_results(model, tok, rows, max_new_tokens=160)
    assert [r["looped"] for r in evaluated] == [False, True]
    assert served == [r["completion"] for r in evaluated]
    unstopped = greedy_results(model, tok, rows, max_new_tokens=160, stop_loops=False)[1]["completion"]
    assert len(served[1]) < len(unstopped), "the test can tell: without the stop the loop runs to the cap"
