"""Bad input stops a stage before anything is written, with an error naming the field, file, row
or directory and the fix: pipeline and stage configs, GSM8K files, a reward's output length,
model sources and model directories.
"""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.train.entry import main
from tests.fault_helpers import short_stage


@pytest.mark.parametrize("override,match", [
    ({"compute": {"nproc_per_node": 2}, "curriculum": {"prompts_per_iter": 3}},
     r"curriculum\.prompts_per_iter: 3 prompts cannot be split across 2 ranks.*multiple of 2"),
    ({"gsm8k": {"gate": {"metric": "eval_accuracy"}, "validation": {"every": 0}}},
     r"stage 'gsm8k'\.gate\.metric.*set validation\.every"),
    ({"gsm8k": {"sampling": {"group_size": 1}}}, r"stage 'gsm8k'\.sampling\.group_size.*group_size >= 2"),
    ({"curriculum": {"loss": {"clip_low": -0.2}}}, r"stage 'curriculum'\.loss\.clip_low: must be >= 0"),
    ({"sft": {"hidden": "64"}}, r"config\.sft\.hidden = '64' has type str; expected <class 'int'>"),
    ({"compute": {"nproc_per_nodes": 2}},
     r"unknown field config\.compute\.nproc_per_nodes\. Did you mean 'nproc_per_node'"),
    ({"curriculm": {}}, r"Did you mean 'curriculum'"),
    ({"evaluate": {"gsm8k": {"size": -1}}},
     r"register\.primary: 'gsm8k_test' is not evaluated \(the evaluated sets are \['arithmetic_test'\]\)"),
    ({"compute": {"nodes": 0}}, r"compute\.nodes: must be a whole number >= 1 \(1: one node, no gang\), got 0"),
    ({"compute": {"nodes": 1.5}}, r"config\.compute\.nodes = 1\.5 has type float"),
    ({"compute": {"nodes": 3, "nproc_per_node": 2}, "curriculum": {"prompts_per_iter": 8}},
     r"curriculum\.prompts_per_iter: 8 prompts cannot be split across 6 ranks \(compute\.nodes x "),
    ({"compute": {"nodes": 2}, "gsm8k": {"prompts_per_iter": 8, "execution": {"parallelism": "fsdp2"}}},
     r"gsm8k\.execution\.parallelism: 'fsdp2' writes every rank's checkpoint shards.*compute\.nodes = 2"),
    ({"compute": {"rdzv_port": 80}}, r"compute\.rdzv_port: must be a free TCP port in 1024\.\.65535.*got 80"),
])
def test_bad_pipeline_config_names_the_field_and_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        PipelineConfig.from_dict(override)


def test_bad_stage_config_writes_nothing(tiny, tmp_path):
    with pytest.raises(ConfigError, match="beta"):
        main(short_stage(tiny, tmp_path / "out", loss=dict(beta=-0.1)))
    assert not (tmp_path / "out").exists()


def _jsonl(*rows) -> str:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)


GOOD = {"question": "Tom has 2 apples and buys 3. How many?", "answer": "2+3=5\n#### 5"}


@pytest.mark.parametrize("files,match", [
    (None, r"GSM8K directory .*/gsm8k does not exist; point GSM8K_DIR"),
    ({"test.jsonl": _jsonl(GOOD)}, r"has no train\.jsonl"),
    ({"train.jsonl": ""}, r"train\.jsonl is empty; it needs one JSON object per line"),
    ({"train.jsonl": _jsonl(GOOD, "{oops")}, r"train\.jsonl line 2 is not valid JSON"),
    ({"train.jsonl": _jsonl(GOOD, {"answer": "#### 4"})},
     r"train\.jsonl row 1 \(0-based\): needs non-empty string fields 'question' and 'answer'.*fix or drop"),
    ({"train.jsonl": _jsonl(GOOD, {"question": "q", "answer": "it is four"})},
     r"train\.jsonl row 1 \(0-based\): gold answer is not a number"),
])
def test_bad_gsm8k_files_name_the_file_and_row(tmp_path, files, match):
    from grpo_core.data.tasks.gsm8k import load

    d = tmp_path / "gsm8k"
    if files is not None:
        d.mkdir()
        for name, text in files.items():
            (d / name).write_text(text)
    with pytest.raises((ValueError, FileNotFoundError), match=match):
        load(str(d), "train")


def test_bad_gsm8k_row_stops_a_stage_before_anything_is_written(tiny, tmp_path, monkeypatch):
    monkeypatch.delenv("GSM8K_DIR", raising=False)  # it would override gsm8k_source
    d = tmp_path / "gsm8k"
    d.mkdir()
    (d / "train.jsonl").write_text(_jsonl(GOOD, GOOD, {"question": "q", "answer": "## none"}))
    with pytest.raises(ValueError, match=r"row 2 \(0-based\): gold answer is not a number"):
        main(short_stage(tiny, tmp_path / "out", task="gsm8k", gsm8k_source=str(d)))
    assert not (tmp_path / "out").exists()


def test_wrong_length_reward_stops_before_any_update_or_checkpoint(tiny, tmp_path):
    with pytest.raises(ValueError,
                       match=r"'tests\.faulty_rewards:wrong_length' returned 15 values, expected a list of 16"):
        main(short_stage(tiny, tmp_path, rewards=[{"fn": "tests.faulty_rewards:wrong_length"}]))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def _tweak_tokenizer(d: Path, **fields) -> None:
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**cfg, **fields}))


def test_model_source_kinds_hub_ids_dirs_and_missing_paths(tiny, tmp_path, monkeypatch):
    """org/name is a hub id (the Kubernetes config's default), an existing dir is loaded from,
    anything path-like that does not exist is an error naming it."""
    from grpo_core.model.loading import _local_model_dir, load_policy

    for hub_id in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", "openai-community/gpt2"):
        assert _local_model_dir(hub_id) == hub_id
    monkeypatch.chdir(tiny.parent)
    assert _local_model_dir(tiny.name) == tiny.name  # a relative dir that exists wins
    for missing in ("a/b/c", "./nope", str(tmp_path / "nope"), "~/no-such-model-dir"):
        with pytest.raises(FileNotFoundError, match=re.escape(repr(missing)) + " does not exist"):
            _local_model_dir(missing)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a hub id goes to the hub (offline here: a clear error)
    with pytest.raises(ValueError, match=r"could not load a tokenizer from 'no-such-org/no-such-model'"):
        load_policy("no-such-org/no-such-model")


def test_bad_model_dirs_are_errors_naming_the_dir_and_fix(tiny, tmp_path):
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    from grpo_core.model.loading import build_char_tokenizer, load_policy

    with pytest.raises(FileNotFoundError, match=r"model path '.*/missing' does not exist"):
        load_policy(str(tmp_path / "missing"))

    no_tok = tmp_path / "no-tokenizer"
    no_tok.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, no_tok)
    with pytest.raises(ValueError, match=r"no-tokenizer' has no tokenizer files.*save_pretrained"):
        load_policy(str(no_tok))

    no_eos = tmp_path / "no-eos"
    shutil.copytree(tiny, no_eos)
    _tweak_tokenizer(no_eos, eos_token=None)
    with pytest.raises(ValueError, match=r"no-eos': tokenizer has no eos_token; set one"):
        load_policy(str(no_eos))

    new_pad = tmp_path / "new-pad"  # a pad token added to the tokenizer, not to the embeddings
    shutil.copytree(tiny, new_pad)
    tok = AutoTokenizer.from_pretrained(new_pad)
    tok.add_special_tokens({"pad_token": "<newpad>"})
    tok.save_pretrained(new_pad)
    with pytest.raises(ValueError, match=r"new-pad': the tokenizer's pad token id \d+ is outside the model's "
                                         r"\d+ embeddings.*resize_token_embeddings"):
        load_policy(str(new_pad))

    no_pad = tmp_path / "no-pad"
    shutil.copytree(tiny, no_pad)
    _tweak_tokenizer(no_pad, pad_token=None)
    _, tok = load_policy(str(no_pad))
    assert tok.pad_token == tok.eos_token == "<eos>" and tok.padding_side == "left"

    bert = tmp_path / "bert"
    cfg = BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                     intermediate_size=64)
    BertForMaskedLM(cfg).save_pretrained(bert)
    build_char_tokenizer().save_pretrained(bert)
    with pytest.raises(ValueError, match=r"bert' is a 'bert' model .*encoder architecture.*decoder-only causal LM"):
        load_policy(str(bert))
