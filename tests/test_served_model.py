"""The served model (the registered pyfunc) answers item by item as the evaluation measured it, on
the prompt path without a chat template too; a load-time max_new_tokens bounds its answers; empty
input is refused with a clear error. Uses a tiny character-level Llama and a sqlite store."""
from __future__ import annotations

import pytest

from grpo_core.tracking.registry import register_model
from grpo_core.tracking.runs import start_parent_run
from grpo_core.tracking.served_model import load_model
from tests.test_registry import evals, model_dir  # noqa: F401  (model_dir: a module fixture)

pytestmark = pytest.mark.usefixtures("no_cwd_writes")
QUESTIONS = ["12+3=", "what is 7 * 8?", "(4-1)*2=", "9-9="]
CAP = 12  # the evaluation's generation cap, registered with the model


@pytest.fixture(scope="module")
def checkpoint(model_dir, tmp_path_factory):  # noqa: F811
    """model_dir's Llama with large random weights (argmax far from ties: answers differ per
    prompt and run to the cap) and no chat template, as the evaluation loads it."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, tok = AutoModelForCausalLM.from_pretrained(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert not getattr(tok, "chat_template", None)
    torch.manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("no-template")
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out, model, tok


@pytest.fixture
def served(sqlite_uri, checkpoint):
    path, *_ = checkpoint
    decision = register_model(sqlite_uri, start_parent_run(sqlite_uri, "grpo-registry", {}), str(path),
                              "grpo-served", eval_items=evals(30), tags={}, rule="always", max_new_tokens=CAP)
    assert decision["decision"] in ("first", "promoted")
    return sqlite_uri


def test_without_a_chat_template_it_answers_as_the_evaluation_item_by_item(served, checkpoint):
    from grpo_core.evaluation.greedy import greedy_results

    _, model, tok = checkpoint
    answers = load_model(served, "grpo-served").predict(QUESTIONS)
    rows = [{"id": q, "prompt": q, "gold": "0"} for q in QUESTIONS]
    evaluated = [r["completion"] for r in greedy_results(model, tok, rows, max_new_tokens=CAP, batch_size=1)]
    assert len(answers) == len(QUESTIONS)
    for q, served_answer, evaluated_answer in zip(QUESTIONS, answers, evaluated):
        assert served_answer == evaluated_answer, q
    assert len(set(answers)) > 1, "the answers depend on the question: the check can tell them apart"
    # the test can tell the prompt paths apart: the bare question (no newline) answers differently
    bare = []
    for q in QUESTIONS:
        enc = tok(q, return_tensors="pt", add_special_tokens=False)
        ids = model.generate(**enc, max_new_tokens=CAP, do_sample=False, pad_token_id=tok.pad_token_id)
        bare.append(tok.decode(ids[0, enc["input_ids"].shape[1]:], skip_special_tokens=True))
    assert bare != answers


def test_a_load_time_cap_bounds_every_answer(served, checkpoint):
    _, _, tok = checkpoint
    full = load_model(served, "grpo-served").predict(QUESTIONS)
    capped = load_model(served, "grpo-served", max_new_tokens=3).predict(QUESTIONS)
    lengths = [len(tok(a, add_special_tokens=False)["input_ids"]) for a in capped]
    assert all(n <= 3 for n in lengths), lengths
    assert any(len(tok(a, add_special_tokens=False)["input_ids"]) > 3 for a in full), full  # the cap did cut
    assert all(f.startswith(c) for f, c in zip(full, capped)), (full, capped)  # greedy: the same start


@pytest.mark.parametrize("bad,message", [
    ([], r"non-empty list of questions"),
    ("12+3=", r"Expected list, but got str"),  # MLflow checks the list[str] type hint first
    (["12+3=", ""], r"question 1 is '': each question must be non-empty text"),
    (["  \n"], r"question 0 is .*: each question must be non-empty text"),
])
def test_empty_input_is_refused_with_a_clear_error(served, bad, message):
    model = load_model(served, "grpo-served")
    with pytest.raises(Exception, match=message):
        model.predict(bad)
