"""The ``vllm`` rollout engine: completions from a ``vllm serve`` process of vLLM's own environment.

    engine.sync_weights(model)           # full weights -> a new directory -> the server reloads them
    engine.generate(rows, G, sampling)   # /v1/completions on token-id prompts -> RolloutBatch

The first ``sync_weights`` writes the policy (safetensors, LoRA merged, the LM head untied) and
starts the server on it; each later one writes a new version directory, asks the server to
``reload_weights`` from it and to drop its prefix cache, then deletes the previous version. vLLM
refreshes its CPU-prepacked linear weights only through ``reload_weights``, and skips a tied LM
head on reload, so the served copy always has an explicit ``lm_head.weight``.

``generate`` renders and encodes prompts as the in-process engines do (``rollout.encode_prompts``),
sends one request per prompt with ``n = G`` (seeded from torch's generator, so a seeded iteration
samples the same completions), and returns the sampled tokens with their log-probs under the
sampling distribution (``--logprobs-mode processed_logprobs``: after temperature) as
``RolloutBatch.sampler_logp``.
"""
from __future__ import annotations

import copy
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from grpo_core.config.checks import vllm_python
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.vllm_server import VllmServer, VllmServerError

SERVED_NAME = "policy"


def served_state_dict(model) -> dict[str, torch.Tensor]:
    """The policy's weights under transformers' names, as a plain checkpoint holds them: LoRA
    layers merged into their base weights (``lora.linear_weights``; the module is not changed)
    and the LM head written out explicitly (untied)."""
    from grpo_core.model import lora
    merged, skip = {}, []
    for name, module in model.named_modules():
        if hasattr(module, "base_layer") and hasattr(module, "get_delta_weight"):
            weight, bias = lora.linear_weights(module)
            merged[f"{name}.weight"] = weight
            if bias is not None:
                merged[f"{name}.bias"] = bias
            skip.append(f"{name}.")
    out = {k: v for k, v in model.state_dict().items() if not any(k.startswith(p) for p in skip)}
    out.update(merged)
    head = model.get_output_embeddings()
    head_name = next(n for n, m in model.named_modules() if m is head)
    out[f"{head_name}.weight"] = head.weight.detach().clone()
    full = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in out.items()}  # FSDP2's DTensors
    return {k: v.detach().to("cpu").contiguous() for k, v in full.items()}


def write_weights(model, directory: Path) -> None:
    """``directory`` (new): config.json (``tie_word_embeddings`` false) and model.safetensors."""
    from safetensors.torch import save_file

    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    config = copy.deepcopy(model.config)
    config.tie_word_embeddings = False
    config.save_pretrained(tmp)
    tensors = served_state_dict(model)
    shared = {}  # safetensors refuses tensors that share storage: give each its own
    for k, v in tensors.items():
        key = (v.untyped_storage().data_ptr(), v.storage_offset())
        tensors[k] = v.clone() if key in shared else v
        shared[key] = k
    save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    tmp.rename(directory)


class VllmEngine:
    """Samples with a vLLM server (see the module's docstring); ``close`` stops it."""

    def __init__(self, tok, spec):
        if spec is None or spec.vllm is None:
            raise ValueError("the vllm engine needs its settings: engines.build(name, tok, stage_cfg or EngineSpec)")
        self.tok, self.spec, self.settings = tok, spec, spec.vllm
        self.python = vllm_python(spec.vllm.python, spec.where)
        self.server, self.version, self.stop_ids = None, 0, None
        self.work = Path(tempfile.mkdtemp(prefix="grpo-vllm-"))

    # ---------------------------------------------------------------- weights
    def sync_weights(self, model) -> None:
        from grpo_core.rollout.generate import stop_token_ids

        self.stop_ids = stop_token_ids(model, self.tok)
        self.version += 1
        new = self.work / f"v{self.version}"
        write_weights(model, new)
        if self.server is None:
            self._start(model, new)
        else:
            self.server.post("/collective_rpc", {"method": "reload_weights",
                                                 "kwargs": {"weights_path": str(new)}})
            self.server.post("/reset_prefix_cache", {})
        old = self.work / f"v{self.version - 1}"
        shutil.rmtree(old, ignore_errors=True)

    def _start(self, model, weights: Path) -> None:
        tok_dir = self.work / "tokenizer"
        self.tok.save_pretrained(tok_dir)
        model.config.save_pretrained(tok_dir)  # vLLM reads a config beside the tokenizer
        device = next(model.parameters()).device
        s, spec = self.settings, self.spec
        max_len = s.max_model_len or spec.max_model_len
        args = ["--tokenizer", str(tok_dir), "--served-model-name", SERVED_NAME,
                "--dtype", "bfloat16" if spec.precision == "bf16" else "float32",
                "--max-model-len", str(max_len), "--seed", str(spec.seed),
                "--logprobs-mode", "processed_logprobs", "--generation-config", "vllm",
                "--disable-uvicorn-access-log"]
        args += (["--kv-cache-memory-bytes", str(s.kv_cache_memory_bytes)] if s.kv_cache_memory_bytes
                 else ["--gpu-memory-utilization", str(s.gpu_memory_utilization)])
        env = {}
        if device.type == "cuda":
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            index = device.index or 0
            env["CUDA_VISIBLE_DEVICES"] = visible.split(",")[index] if visible else str(index)
        else:  # vLLM-CPU rewinds a seeded request's generator after a partial (chunked) prefill, which
            # CPU generators cannot do ("CPU Generator does not use offset"): prefill whole prompts
            args += ["--enforce-eager", "--no-enable-chunked-prefill",
                     "--max-num-batched-tokens", str(max(max_len, 4096))]
        rank = os.environ.get("RANK", "0")
        log = Path(spec.log_dir) / f"vllm-server-rank{rank}.log"
        self.server = VllmServer(self.python, str(weights), args + list(s.extra_args), port=s.port,
                                 startup_timeout_s=s.startup_timeout_s, log_path=log, env=env)
        self.server.start()

    # ---------------------------------------------------------------- sampling
    def generate(self, rows: list[dict], group_size: int, sampling) -> RolloutBatch:
        from grpo_core.rollout.generate import encode_prompts

        if self.server is None:
            raise RuntimeError("sync_weights(model) must come before generate()")
        prompts = [r["prompt"] for r in rows]
        ids, mask = encode_prompts(self.tok, prompts, sampling.max_prompt_tokens,
                                   [r.get("id", "") for r in rows], sampling.system_prompt)  # [N, P]
        token_lists = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
        base_seed = int(torch.randint(0, 2**31 - 1, ()).item())  # torch's generator: reseeded per iteration
        bodies = [self._request(p, group_size, sampling, base_seed + i * group_size)
                  for i, p in enumerate(token_lists)]
        with ThreadPoolExecutor(max_workers=min(len(bodies), 64)) as pool:
            answers = list(pool.map(self._complete, bodies))
        tokens, logps = [], []
        for answer in answers:
            for choice in sorted(answer["choices"], key=lambda ch: ch["index"]):
                tokens.append(list(choice["token_ids"]))
                logps.append([float(x) for x in choice["logprobs"]["token_logprobs"]])
        return self._batch(rows, prompts, ids, mask, tokens, logps, group_size)

    def _request(self, prompt: list[int], n: int, sampling, seed: int) -> dict:
        greedy = sampling.greedy
        return {"model": SERVED_NAME, "prompt": prompt, "n": n, "max_tokens": sampling.max_new_tokens,
                "temperature": 0.0 if greedy else sampling.temperature,
                "top_p": 1.0 if greedy else sampling.top_p,
                "top_k": -1 if greedy or not sampling.top_k else sampling.top_k,
                "seed": seed, "stop_token_ids": self.stop_ids, "logprobs": 0, "return_token_ids": True,
                "skip_special_tokens": False, "include_stop_str_in_output": True}

    def _complete(self, body: dict) -> dict:
        return self.server.post("/v1/completions", body, timeout_s=self.settings.request_timeout_s)

    def _batch(self, rows, prompts, ids, mask, tokens, logps, group_size) -> RolloutBatch:
        from grpo_core.rollout.generate import completion_mask

        pad = self.tok.pad_token_id
        width = max(1, max(len(t) for t in tokens))
        comp = torch.full((len(tokens), width), pad, dtype=torch.long)               # [B, T]
        sampler_logp = torch.zeros((len(tokens), width), dtype=torch.float32)         # [B, T]
        for i, (t, lp) in enumerate(zip(tokens, logps)):
            if len(lp) != len(t):
                raise VllmServerError(f"vLLM returned {len(t)} tokens but {len(lp)} log-probs for completion {i}")
            comp[i, :len(t)] = torch.tensor(t, dtype=torch.long)
            sampler_logp[i, :len(lp)] = torch.tensor(lp, dtype=torch.float32)
        cmask, truncated = completion_mask(comp, self.stop_ids)
        comp = comp.masked_fill(~cmask, pad)
        sampler_logp = sampler_logp.masked_fill(~cmask, 0.0)
        texts = self.tok.batch_decode(comp, skip_special_tokens=True)
        columns = {k: [r[k] for r in rows for _ in range(group_size)] for k in rows[0] if k != "prompt"}
        return RolloutBatch(ids.repeat_interleave(group_size, 0), mask.repeat_interleave(group_size, 0), comp,
                            cmask, truncated, group_size, [p for p in prompts for _ in range(group_size)], texts,
                            columns, sampler_logp=sampler_logp)

    # ---------------------------------------------------------------- lifetime
    def close(self) -> None:
        """Stop the server and delete the weight versions; idempotent."""
        if self.server is not None:
            self.server.stop()
            self.server = None
        shutil.rmtree(self.work, ignore_errors=True)

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
