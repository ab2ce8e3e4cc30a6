"""The registered model as MLflow serves it: a pyfunc ("models from code") over the Hugging Face
checkpoint directory that decodes greedily the way the evaluation measured, and the calls that log
and load it. The pyfunc's code is a string written to a file at logging time, so the loaded model
depends only on mlflow, torch and transformers, never on this package or on cloudpickle.
"""
from __future__ import annotations

import contextlib
import importlib.metadata
import os
import tempfile
from pathlib import Path

from grpo_core.tracking.runs import env_defaults, mlflow_client

QUIET = {"MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}  # tqdm bars flood step logs
DEFAULT_MAX_NEW_TOKENS = 256  # enough for a GSM8K chain of thought; override at load time

# Written to a temp file and logged as "models from code": the loaded model then depends only
# on mlflow, torch and transformers, never on this package or on cloudpickle.
PYFUNC_CODE = '''\
"""Greedy text generation over a Hugging Face causal-LM directory (MLflow pyfunc).

``predict`` takes raw questions (as in the datasets) and answers them the way the evaluation that
registered this model measured it: the same prompt format (the tokenizer's chat template, else the
question and a newline; no added special tokens), plain argmax decoding (the checkpoint's
generation_config extras, such as repetition_penalty, are not applied), and an answer that repeats
itself verbatim stops where the evaluation stopped it. An empty list, or a question that is not
non-empty text, is refused with a ValueError naming it.
"""
import mlflow
from mlflow.pyfunc import PythonModel
from transformers import StoppingCriteria


class LoopStop(StoppingCriteria):
    """grpo_core.rollout.loops.LoopRule's rule for one sequence, with the rule's numbers from the model's
    config (this file must not import grpo_core): stop once the answer's last tokens repeat with a
    period p <= max_period at least min_repeats times, over min_span tokens or more."""

    def __init__(self, start: int, min_repeats: int, min_span: int, max_period: int):
        self.start, self.runs = start, [0] * (max_period + 1)  # per period p: tokens equal to the one p before
        self.need = [max((min_repeats - 1) * p, min_span - p) for p in range(max_period + 1)]

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        seq = input_ids[0, self.start:].tolist()
        t, hit = len(seq) - 1, False
        for p in range(1, len(self.runs)):
            self.runs[p] = self.runs[p] + 1 if t >= p and seq[t] == seq[t - p] else 0
            hit = hit or self.runs[p] >= self.need[p]
        return torch.tensor([hit], device=input_ids.device)


class GreedyCausalLM(PythonModel):
    def load_context(self, context):
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

        model_dir = context.artifacts["model_dir"]
        self.tok = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
        # stop where training and evaluation stopped: the tokenizer's eos, then the checkpoint's others
        listed = self.model.generation_config.eos_token_id
        stop = [self.tok.eos_token_id] + [i for i in ([listed] if isinstance(listed, int) else listed or [])
                                          if i != self.tok.eos_token_id]
        self.model.generation_config = GenerationConfig(pad_token_id=self.tok.pad_token_id, eos_token_id=stop)
        config = context.model_config or {}
        self.max_new_tokens = int(config.get("max_new_tokens", 256))
        self.system_prompt = config.get("system_prompt")  # absent: the chat template's default system turn
        self.loop_rule = config["loop_rule"]  # the evaluation's (grpo_core.rollout.loops.LoopRule)

    def render(self, question: str) -> str:
        # the rule of grpo_core.rollout.generate.render_prompts (this file must not import grpo_core)
        turns = [{"role": "user", "content": question}]
        if self.system_prompt is not None:
            turns = [{"role": "system", "content": self.system_prompt}] + turns
        if getattr(self.tok, "chat_template", None):
            return self.tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
        return ("" if self.system_prompt is None else self.system_prompt + "\\n") + question + "\\n"

    def predict(self, context, model_input: list[str], params=None) -> list[str]:
        import torch

        if isinstance(model_input, str) or not isinstance(model_input, (list, tuple)) or not model_input:
            raise ValueError("predict takes a non-empty list of questions (strings), e.g. ['What is 2 + 3?'];"
                             f" got {model_input!r:.80}")
        for i, question in enumerate(model_input):
            if not isinstance(question, str) or not question.strip():
                raise ValueError(f"question {i} is {question!r:.80}: each question must be non-empty text")
        out = []
        for question in model_input:  # one at a time: no padding side to get wrong
            enc = self.tok(self.render(question), return_tensors="pt", add_special_tokens=False)
            start = enc["input_ids"].shape[1]
            with torch.no_grad():
                ids = self.model.generate(**enc, max_new_tokens=self.max_new_tokens, do_sample=False,
                                          stopping_criteria=[LoopStop(start, **self.loop_rule)])
            out.append(self.tok.decode(ids[0, start:], skip_special_tokens=True))
        return out


mlflow.models.set_model(GreedyCausalLM())
'''


@contextlib.contextmanager
def use_uri(uri: str):
    """Point MLflow's process-wide tracking/registry URI at ``uri`` for one call, then restore.

    ``Model.log`` and ``pyfunc.load_model`` read only the global URI; setting it also writes
    the env var, which would then outrank a caller's configuration.
    """
    import mlflow
    from mlflow.tracking._model_registry import utils as reg_utils
    from mlflow.tracking._tracking_service import utils as trk_utils

    env_keys = ("MLFLOW_TRACKING_URI", "MLFLOW_REGISTRY_URI")
    saved = (trk_utils._tracking_uri, reg_utils._registry_uri, {k: os.environ.get(k) for k in env_keys})
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    try:
        with env_defaults(**QUIET):
            yield
    finally:
        trk_utils._tracking_uri, reg_utils._registry_uri = saved[0], saved[1]
        for k, v in saved[2].items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def load_model(uri: str, name: str, alias: str = "champion", max_new_tokens: int | None = None):
    """Load ``models:/name@alias`` as a pyfunc whose ``predict(list[str])`` returns completions."""
    import mlflow

    config = None if max_new_tokens is None else {"max_new_tokens": max_new_tokens}
    with use_uri(uri):
        return mlflow.pyfunc.load_model(f"models:/{name}@{alias}", model_config=config)


def _pip_requirements() -> list[str]:
    """Pinned requirements, given explicitly so MLflow does not load the model to infer them."""
    def ver(pkg: str) -> str:
        return importlib.metadata.version(pkg).split("+")[0]  # drop "+cpu" local tags
    return [f"{p}=={ver(p)}" for p in ("mlflow", "torch", "transformers", "safetensors")]


def log_pyfunc_model(uri: str, run_id: str, model_dir: str, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                     system_prompt: str | None = None):
    """Log ``model_dir`` as a pyfunc LoggedModel attached to the run; returns ModelInfo. It serves
    with the evaluation's generation cap, system prompt (None: the chat template's default) and
    loop rule."""
    import dataclasses

    import mlflow
    from mlflow.models import Model

    from grpo_core.rollout.loops import LoopRule

    # Created here so it lands in the run's experiment: Model.log alone would use the
    # process's active experiment (the Default one, with artifacts under ./mlruns).
    client = mlflow_client(uri)
    experiment_id = client.get_run(run_id).info.experiment_id
    logged = client.create_logged_model(experiment_id, name="model", source_run_id=run_id)
    with tempfile.TemporaryDirectory() as tmp, use_uri(uri):
        code = Path(tmp) / "grpo_pyfunc_model.py"
        code.write_text(PYFUNC_CODE)
        return Model.log(artifact_path=None, name="model", flavor=mlflow.pyfunc, run_id=run_id,
                         model_id=logged.model_id,
                         python_model=str(code), artifacts={"model_dir": str(model_dir)},
                         pip_requirements=_pip_requirements(),
                         model_config={"max_new_tokens": max_new_tokens, "loop_rule": dataclasses.asdict(LoopRule()),
                                       **({} if system_prompt is None else {"system_prompt": system_prompt})})
