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
    [ci_pytest] = re.findall(r"^python -m pytest.*$", CI_RUN, flags=re.M)
    assert cmd.endswith(ci_pytest), (cmd, ci_pytest)
    assert "--durations=25" in ci_pytest


def test_readme_registry_example_names_the_model_the_default_registers():
    with open(REPO / "flows" / "configs" / "local.toml", "rb") as f:
        local = tomllib.load(f)
    from grpo_core.pipeline_config import PipelineConfig

    registered = PipelineConfig.from_dict(local).register.model_name
    examples = re.findall(r"python -m grpo_core\.registry compare (\S+)", README)
    assert examples and set(examples) == {registered}, (examples, registered)
