"""README's commands and the code they name agree: the test command is what CI runs, and the
registry example names the model the default run registers."""
import re
import tomllib

from tests.helpers import REPO

README = (REPO / "README.md").read_text()
CI_RUN = (REPO / ".ci" / "run").read_text()


def _readme_test_command() -> str:
    [cmd] = [line for line in README.splitlines() if "requirements-dev.txt" in line and "pytest" in line]
    return cmd


def test_readme_test_command_installs_and_runs_what_ci_runs():
    cmd = _readme_test_command()
    req_files = r"-r (requirements[\w-]*\.txt)"
    ci_installs = re.findall(req_files, CI_RUN)
    assert ci_installs and set(re.findall(req_files, cmd)) == set(ci_installs), (cmd, ci_installs)
    assert "requirements-bench.txt" in ci_installs, "the TRL smoke test needs trl"
    ci_scripts = re.findall(r"^(infra/[\w-]+\.sh)", CI_RUN, flags=re.M)  # chromium, the vLLM venv
    assert ci_scripts and all(s in cmd for s in ci_scripts), (cmd, ci_scripts)
    [ci_pytest] = re.findall(r"^python -m pytest.*$", CI_RUN, flags=re.M)
    assert cmd.endswith(ci_pytest), (cmd, ci_pytest)
    assert "--durations=25" in ci_pytest


def test_readme_registry_example_names_the_model_the_default_registers():
    with open(REPO / "flows" / "configs" / "local.toml", "rb") as f:
        local = tomllib.load(f)
    from grpo_core.config.pipeline import PipelineConfig

    registered = PipelineConfig.from_dict(local).register.model_name
    examples = re.findall(r"python -m grpo_core\.tracking\.registry compare (\S+)", README)
    assert examples and set(examples) == {registered}, (examples, registered)


def test_readme_mlflow_ui_opens_the_store_the_flow_and_the_registry_cli_use(monkeypatch):
    """README's `mlflow ui --backend-store-uri sqlite:///$PWD/...`, typed in the repo root, opens
    the db the flow's start and `python -m grpo_core.tracking.registry compare` resolve by default."""
    from grpo_core.pipeline.steps import PROJECT_DIR
    from grpo_core.tracking import registry
    from grpo_core.tracking.runs import resolve_tracking_uri

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    [store] = re.findall(r"^mlflow ui --backend-store-uri (\S+)", README, flags=re.M)
    typed = store.replace("$PWD", str(REPO))
    assert typed == resolve_tracking_uri(None, str(PROJECT_DIR)) == f"sqlite:///{registry.PROJECT_DIR}/.grpo/mlflow/mlflow.db"


def test_readme_flow_commands_name_config_files_that_exist():
    configs = re.findall(r"python flows/grpo_flow\.py [^\n`]*?--config cfg (flows/configs/\S+)", README)
    assert configs, "README shows no --config command"
    for path in configs:
        assert (REPO / path).is_file(), path
