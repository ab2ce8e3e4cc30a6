"""The config module against the code it configures, and the range checks every table gets at load."""
import math
import tomllib
from pathlib import Path

import pytest

from grpo_core.config.checks import ConfigError
from grpo_core.config.pipeline import PipelineConfig, deep_merge
from grpo_core.config.stage import GRPOConfig


def test_config_choices_are_exactly_what_the_math_accepts():
    """config.py keeps its own copies (it validates before torch is imported, so it cannot import
    grpo_core.algo.core): a choice added on one side only would pass validation and fail at
    iteration 1, or be unreachable. Loss types are read from grpo_core.algo.losses when a stage is
    validated, so they cannot drift."""
    from grpo_core.algo import core as algorithm
    from grpo_core.algo import losses, objective
    from grpo_core.config import groups as config
    assert config.SCALES == algorithm.ADVANTAGE_SCALES == tuple(objective.SCALES)
    assert config.loss_type_names() == tuple(losses.LOSS_TYPES)
    from grpo_core.model import loading as models
    assert config.TINY_ARCHITECTURES == models.ARCHITECTURES


@pytest.mark.parametrize("sft,match", [
    ({"hidden": 64, "heads": 5}, r"sft\.heads: hidden 64 / heads 5 must be an even whole head size"),
    ({"hidden": 12, "heads": 4}, r"sft\.heads: hidden 12 / heads 4"),  # head size 3: odd
    ({"layers": 0}, r"sft\.layers: must be >= 1, got 0"),
    ({"arch": "gpt2"}, r"sft\.arch: 'gpt2' is not allowed; use one of llama, qwen2"),
    ({"arithmetic_min": 9, "arithmetic_max": 3}, r"sft\.arithmetic_min: must be <= arithmetic_max"),
    ({"arithmetic_ops": "/"}, r"sft\.arithmetic_ops: '/': use a non-empty subset"),
    ({"gsm8k_examples": -1}, r"sft\.gsm8k_examples: must be >= 0"),
])
def test_a_bootstrap_model_that_cannot_be_built_is_refused_at_load(sft, match):
    """These used to fail in load_sft, after start had opened the MLflow run (or inside transformers)."""
    with pytest.raises(ConfigError, match=match):
        PipelineConfig.from_dict({"sft": sft})


def test_tiny_model_fields_are_not_checked_for_a_given_checkpoint():
    assert PipelineConfig.from_dict({"sft": {"source": "Qwen/Qwen2.5-0.5B", "heads": 5}}).sft.heads == 5


@pytest.mark.parametrize("compute,match", [
    ({"secrets": ["ok", 3]}, r"compute\.secrets: .*a list of Kubernetes secret names"),
    ({"node_selector": {"pool": 1}}, r"compute\.node_selector: .*map strings to strings"),
    ({"tolerations": ["nvidia.com/gpu"]}, r"compute\.tolerations: .*a list of Kubernetes toleration tables"),
])
def test_kubernetes_pod_fields_have_the_shapes_kubernetes_takes(compute, match):
    with pytest.raises(ConfigError, match=match):
        PipelineConfig.from_dict({"compute": compute})


@pytest.mark.parametrize("metric", ["eval_accuracy", "informative_frac"])
def test_a_gate_threshold_a_fraction_cannot_reach_is_refused(metric):
    with pytest.raises(ConfigError, match=rf"gate\.threshold: 1.5 can never be reached: {metric} is a fraction"):
        GRPOConfig(gate=dict(metric=metric, threshold=1.5), validation=dict(every=1))
    assert GRPOConfig(gate=dict(metric="reward", threshold=1.5)).gate.threshold == 1.5  # weighted rewards may exceed 1


# ---------------------------------------------------------------- range checks at config load
CONFIGS = Path(__file__).resolve().parents[1] / "flows" / "configs"
K8S = {"storage_root": "s3://bucket/prefix", "compute": {"backend": "kubernetes"}}


@pytest.fixture(autouse=True)
def _no_storage_root_override(monkeypatch):
    """GRPO_STORAGE_ROOT overrides storage_root at validation: one exported in the shell running the
    tests would turn the Kubernetes storage checks below into tests of the environment."""
    monkeypatch.delenv("GRPO_STORAGE_ROOT", raising=False)


def _toml(name: str) -> dict:
    with open(CONFIGS / name, "rb") as f:
        return tomllib.load(f)


@pytest.mark.parametrize("name", ["local.toml", "tiny.toml", "kubernetes.toml"])
def test_shipped_configs_validate(name):
    pc = PipelineConfig.from_dict(_toml(name))
    assert pc.name == name.removesuffix(".toml")


@pytest.mark.parametrize("patience", [0, -1])
def test_gate_patience_below_one_is_refused(patience):
    """0 would promote before the first measurement: the stage trains no iteration at all."""
    with pytest.raises(ConfigError, match=rf"stage 'curriculum'\.gate\.patience: must be >= 1, got {patience}"):
        PipelineConfig.from_dict({"curriculum": {"gate": {"metric": "reward", "patience": patience}}})
    with pytest.raises(ConfigError, match=r"gate\.patience"):
        GRPOConfig(runtime=dict(model="m"), gate=dict(patience=patience))


@pytest.mark.parametrize("override,match", [
    ({"evaluate": {"batch_size": 0}}, r"evaluate\.batch_size: must be >= 1, got 0"),
    ({"evaluate": {"max_new_tokens": 0}}, r"evaluate\.max_new_tokens: must be >= 1, got 0"),
    ({"evaluate": {"arithmetic": {"size": -2}}}, r"evaluate\.arithmetic\.size: must be >= -1 .*-1 to skip\), got -2"),
    ({"evaluate": {"gsm8k": {"bounded_size": -1}}}, r"evaluate\.gsm8k\.bounded_size: must be >= 0, got -1"),
    ({"evaluate": {"gsm8k": {"sized": 3}}}, r"unknown field config\.evaluate\.gsm8k\.sized\. Did you mean 'size'"),
    ({"evaluate": {"arithmetic": {"max_difficulty": 2}}},
     r"evaluate\.arithmetic\.max_difficulty: task 'arithmetic' has no difficulty bound"),
    ({"evaluate": {"gsm8k_size": 5}},
     r"evaluate\.gsm8k_size moved to the task's table: write it as \[evaluate\.gsm8k\] size"),
    ({"evaluate": {"engine": "sglang"}}, r"evaluate\.engine"),
    ({"evaluate": {"gsm8k": 5}}, r"evaluate\.gsm8k: must be a table \(\[evaluate\.gsm8k\] with size"),
    ({"evaluate": {"gsm8": {"size": 5}}},
     r"unknown field config\.evaluate\.gsm8: neither an \[evaluate\] field nor a task's table .*Did you mean 'gsm8k'"),
    ({"evaluate": {"tasks": {"gsm8k": {"size": 5}}}},
     r"evaluate\.tasks: write each task's table as \[evaluate\.<task>\]"),
    ({"evaluate": {"engine": "vllm", "vllm": {"python": "/nowhere/venv"}}},
     r"evaluate\.vllm\.python = '/nowhere/venv': no vLLM environment .*infra/vllm-env\.sh"),
    ({"gsm8k": {"sampling": {"rollout_engine": "vllm"}, "vllm": {"python": "/nowhere/venv"}}},
     r"gsm8k\.vllm\.python = '/nowhere/venv': no vLLM environment"),
    ({"evaluate": {"vllm": {"port": 70000}}}, r"evaluate\.vllm\.port: must be in 0\.\.65535"),
    ({"register": {"alpha": 0}}, r"register\.alpha: must be .*strictly between 0 and 1"),
    ({"register": {"alpha": 1.0}}, r"register\.alpha: must be .*strictly between 0 and 1"),
    ({"register": {"alpha": -0.05}}, r"register\.alpha"),
    ({"register": {"alpha": math.nan}}, r"register\.alpha: .*got nan"),
    ({"register": {"alpha": math.inf}}, r"register\.alpha: .*got inf"),
    ({"sft": {"lr": math.inf}}, r"sft\.lr: must be a finite number > 0, got inf"),
    ({"curriculum": {"gate": {"metric": "reward", "threshold": math.nan}}},
     r"stage 'curriculum'\.gate\.threshold: must be a finite number, got nan"),
    ({"gsm8k": {"gate": {"threshold": math.inf}}}, r"stage 'gsm8k'\.gate\.threshold: must be a finite number"),
    ({"gsm8k": {"validation": {"max_new_tokens": -1}}},
     r"stage 'gsm8k'\.validation\.max_new_tokens: must be >= 0, got -1"),
    ({"gsm8k": {"sampling": {"max_resample_rounds": -1}}}, r"'gsm8k'\.sampling\.max_resample_rounds: must be >= 0"),
    ({"curriculum": {"loss": {"clip_high": math.inf}}}, r"'curriculum'\.loss\.clip_high: must be a finite number >= 0"),
    ({"curriculum": {"loss": {"clip_high": math.nan}}}, r"stage 'curriculum'\.loss\.clip_high"),
    ({"curriculum": {"optim": {"max_grad_norm": math.inf}}},
     r"stage 'curriculum'\.optim\.max_grad_norm: must be >= 0 and finite, got inf"),
    ({"curriculum": {"optim": {"lr": math.nan}}}, r"'curriculum'\.optim\.lr: must be a finite number > 0, got nan"),
    ({"compute": {"threads_per_proc": 0}}, r"compute\.threads_per_proc: must be >= 1, got 0"),
    ({"compute": {"cpu": 0}}, r"compute\.cpu: must be >= 1, got 0"),
    ({"compute": {"memory": -8192}}, r"compute\.memory: must be >= 1, got -8192"),
    ({"compute": {"gpu": -1}}, r"compute\.gpu: must be >= 0"),
    ({"compute": {"shared_memory": 0}}, r"compute\.shared_memory: must be >= 1 \(MiB\) or omitted, got 0"),
    ({"compute": {"disk": -1}}, r"compute\.disk: must be >= 1 \(MiB\) or omitted, got -1"),
])
def test_out_of_range_values_name_the_field_and_fix(override, match):
    with pytest.raises(ConfigError, match=match):
        PipelineConfig.from_dict(override)


def test_boundary_values_are_accepted():
    pc = PipelineConfig.from_dict({
        "evaluate": {"gsm8k": {"size": -1}, "arithmetic": {"size": 1}, "max_new_tokens": 1, "batch_size": 1},
        "register": {"alpha": 0.5, "primary": "arithmetic_test"},
        "compute": {"threads_per_proc": 1, "cpu": 1, "memory": 1, "gpu": 0, "shared_memory": 1, "disk": 1},
        "curriculum": {"gate": {"metric": "reward", "threshold": -0.5, "patience": 1},
                       "validation": {"max_new_tokens": 0}, "sampling": {"max_resample_rounds": 0},
                       "loss": {"clip_high": 0.28}},
    })
    assert pc.eval_set_names() == ["arithmetic_test"] and pc.compute.disk == 1
    assert pc.stage("curriculum", model="m").gate.patience == 1


@pytest.mark.parametrize("root", [".grpo/artifacts", "/mnt/shared/artifacts", "gs://bucket/prefix", "file:///x"])
def test_kubernetes_needs_s3_storage(root):
    """A local storage_root on Kubernetes: each pod checkpoints to its own ephemeral disk and the
    next step finds nothing."""
    with pytest.raises(ConfigError, match=r"storage_root: .*compute\.backend = 'kubernetes'.*ephemeral disk"
                                          r".*set storage_root to an s3://"):
        PipelineConfig.from_dict({**K8S, "storage_root": root})


def test_kubernetes_storage_check_reads_the_environment_override(monkeypatch):
    """GRPO_STORAGE_ROOT wins over storage_root at run time, so it is what the check must read."""
    monkeypatch.setenv("GRPO_STORAGE_ROOT", "/tmp/artifacts")
    with pytest.raises(ConfigError, match=r"GRPO_STORAGE_ROOT \(environment\): '/tmp/artifacts' is not an s3://"
                                          r".*set GRPO_STORAGE_ROOT to an s3://"):
        PipelineConfig.from_dict(K8S)
    monkeypatch.setenv("GRPO_STORAGE_ROOT", "s3://other/prefix")
    assert PipelineConfig.from_dict({**K8S, "storage_root": ".grpo/artifacts"}).compute.backend == "kubernetes"


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "file:///tmp/mlruns", "mlruns"])
def test_kubernetes_needs_a_reachable_tracking_server(uri):
    with pytest.raises(ConfigError, match=r"tracking_uri: .*compute\.backend = 'kubernetes'.*http\(s\)://"):
        PipelineConfig.from_dict({**K8S, "tracking_uri": uri})


@pytest.mark.parametrize("uri", [None, "http://mlflow:5000", "https://mlflow.example.com", "databricks"])
def test_kubernetes_tracking_uri_servers_or_unset_are_accepted(uri):
    """Unset is resolved from MLFLOW_TRACKING_URI at run start (checked there, not here)."""
    pc = PipelineConfig.from_dict({**K8S, **({"tracking_uri": uri} if uri else {})})
    assert pc.tracking_uri == uri


def test_local_backend_keeps_local_storage_and_sqlite():
    pc = PipelineConfig.from_dict({"tracking_uri": "sqlite:///x.db"})
    assert pc.storage_root == ".grpo/artifacts"


def test_kubernetes_config_without_resources_gets_the_defaults():
    """What flows/compute.py builds @kubernetes from: the validated compute table, defaults filled."""
    cfg = _toml("kubernetes.toml")
    for key in ("gpu", "cpu", "memory", "shared_memory", "disk"):
        del cfg["compute"][key]
    one_rank = {"prompts_per_iter": 64, "execution": {"parallelism": "ddp"}}  # fsdp2 needs >= 2 ranks
    cfg = deep_merge(cfg, {"compute": {"nproc_per_node": 1}, "curriculum": one_rank, "gsm8k": one_rank})
    c = PipelineConfig.from_dict(cfg).compute
    assert (c.gpu, c.cpu, c.memory, c.shared_memory, c.disk) == (0, 2, 8192, None, None)


@pytest.mark.parametrize("uri", ["https://alice:s3cret@mlflow.example.com", "http://token@mlflow:5000"])
def test_credentials_in_the_tracking_uri_are_refused(uri, monkeypatch):
    """The URI travels in every stage's config and the flow's artifacts: credentials go in the
    environment (MLFLOW_TRACKING_USERNAME/PASSWORD/TOKEN), and the error does not echo them."""
    from grpo_core.tracking.runs import resolve_tracking_uri

    with pytest.raises(ConfigError, match=r"tracking_uri: .*holds credentials.*MLFLOW_TRACKING_USERNAME") as err:
        PipelineConfig.from_dict({"tracking_uri": uri})
    assert "s3cret" not in str(err.value) and "token@" not in str(err.value)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ValueError, match="holds credentials"):
        resolve_tracking_uri(None, ".")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "postgresql://u:p@db/mlflow")  # a database store: its own URI form
    assert resolve_tracking_uri(None, ".") == "postgresql://u:p@db/mlflow"


def test_the_stage_table_names_each_stage_once_with_a_known_task():
    from grpo_core.config.stages import EVALUATED, GRPO_STAGES, stage
    from grpo_core.data.tasks import registry

    assert [s.name for s in GRPO_STAGES] == list(EVALUATED[1:]) and EVALUATED[0] == "sft"
    assert all(s.task in registry() for s in GRPO_STAGES)
    pc = PipelineConfig.from_dict({})
    assert [pc.stage(s.name, model="m").task for s in GRPO_STAGES] == [s.task for s in GRPO_STAGES]
    assert stage("curriculum").task == "arithmetic"
    with pytest.raises(KeyError, match=r"no GRPO stage 'warmup'; the stages are \['curriculum', 'gsm8k'\]"):
        stage("warmup")


def test_the_configuration_page_reference_is_the_one_generated_from_the_field_docstrings():
    """Fields are documented once, in their docstrings: docs/configuration.md's reference block
    must be exactly what the generator makes of them, and every field must have one."""
    import dataclasses

    from grpo_core.config.evaluation import EvalConfig, TaskEval
    from grpo_core.config.groups import GROUPS, StageRuntime
    from grpo_core.config.pipeline import ComputeConfig, RegisterConfig, SFTConfig
    from grpo_core.config.reference import DEFAULT_TARGET, TABLES, field_docs, reference, replaced

    page = (Path(__file__).resolve().parents[1] / DEFAULT_TARGET).read_text()
    fix = "python -m grpo_core.config.reference --write"
    assert replaced(page) == page, f"{DEFAULT_TARGET}'s config reference drifted from the docstrings: {fix}"
    for cls in (PipelineConfig, ComputeConfig, SFTConfig, GRPOConfig, *GROUPS.values(), StageRuntime, EvalConfig,
                TaskEval, RegisterConfig):
        docs = field_docs(cls)
        undocumented = [f.name for f in dataclasses.fields(cls) if f.name not in docs and f.name not in TABLES]
        assert not undocumented, f"{cls.__name__} fields without a docstring: {undocumented}"
    table = reference()
    assert "| `micro_batch_groups` | `0` |" in table and "| `primary` | `\"gsm8k_test\"` |" in table
    assert "`tracking_run_id`" in table.split("Filled in by the flow")[1]  # runtime fields listed, not tabled
    assert "| `tracking_run_id` |" not in table
    edited = page.replace("| `lr` | `0.0001` |", "| `lr` | `0.001` |")
    assert edited != page and replaced(edited) == page  # a hand edit is what the test catches


def test_each_grpo_stage_row_has_its_config_table_and_flow_steps():
    """A GRPO stage is declared by its stage-table row: the pipeline config has its table, the
    flow its training step, and nothing else lists the stages by hand (the flow's evaluation
    order, artifact lists and summary derive from the table)."""
    import dataclasses

    from grpo_core.config.pipeline import PipelineConfig
    from grpo_core.config.stages import GRPO_STAGES

    fields = {f.name for f in dataclasses.fields(PipelineConfig)}
    flow = (Path(__file__).resolve().parents[1] / "flows" / "grpo_flow.py").read_text()
    for s in GRPO_STAGES:
        assert s.name in fields, f"PipelineConfig needs a {s.name!r} table"
        assert f"def {s.step}(self)" in flow and f'self._train("{s.name}"' in flow, s
    by_hand = [line for line in flow.splitlines() if '"curriculum"' in line and '"gsm8k"' in line]
    assert not by_hand, f"the flow lists the stages by hand: {by_hand}"
