"""A bad stage config (a field, a file, a reward path, prompts that do not split across ranks, an
empty system prompt) is refused before training, with an error naming the field and the fix.
"""

import pytest
import torch

from grpo_core.config.checks import ConfigError
from grpo_core.train.entry import load_config, main
from tests.helpers import stage_args
from tests.trainer_helpers import trainer_stage


def test_prompts_that_do_not_split_across_ranks_are_refused_not_dropped(tiny, tmp_path):
    """3 prompts on 2 ranks: sharding would drop one every iteration, silently (only the pipeline
    config checked this; ``python -m grpo_core.train`` under torchrun did not)."""
    from grpo_core.policy import dist
    from grpo_core.train.trainer import Trainer

    cfg = load_config(None, [a.removeprefix("--set=") for a in trainer_stage(tiny, tmp_path, prompts_per_iter=3)])
    with pytest.raises(ConfigError, match=r"stage 'grpo'\.prompts_per_iter: 3 prompts cannot be split across 2 ranks"):
        Trainer(cfg, dist.DistInfo(0, 2, 0, torch.device("cpu")))


@pytest.mark.parametrize("override,match", [
    ("sampling.group_size=1", r"sampling\.group_size"), ("loss.clip_low=-0.1", r"loss\.clip_low"),
    ("loss.beta=-1", r"loss\.beta"), ("loss.type=ppo", r"loss\.type.*grpo, bnpo, dapo, dr_grpo"),
    ("sampling.grop_size=4", "Did you mean 'group_size'"),
    ("group_size=4", r"belongs in the 'sampling' group: stage\.sampling\.group_size"),
    ("keep=2", r"belongs in the 'checkpoint' group: stage\.checkpoint\.keep"),
    ("optim.lr=\"fast\"", r"stage\.optim\.lr"), ("gate.metric=\"eval_accuracy\"", r"validation\.every"),
    ("rewards=[{\"func\": \"x\"}]", "rewards\\[0\\]"),
    ("sampling.sampler=\"gumbel\"", "sampler.*inverse_cdf, multinomial"),
    ("execution.collective_timeout_s=0",
     r"stage 'grpo'\.execution\.collective_timeout_s: must be a finite number > 0"),
    ("optim=3", r"stage\.optim must be a table"), ("optim.lr.x=1", r"stage\.optim\.lr = \{'x': 1\} has type dict"),
])
def test_bad_stage_config_names_the_field(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, [override])


@pytest.mark.parametrize("text,match", [
    ('{"iterations": 4,,}', r"bad\.json: not valid JSON at line 1"), ("[1, 2]", r"bad\.json: expected a JSON object"),
    (None, r"bad\.json: cannot read it"),
])
def test_bad_stage_config_file_names_the_file(tmp_path, text, match):
    path = tmp_path / "bad.json"
    if text is not None:
        path.write_text(text)
    with pytest.raises(ConfigError, match=match):
        load_config(str(path), [])


def test_bad_reward_path_is_reported_before_training(tiny, tmp_path):
    with pytest.raises(ValueError, match="grpo_core.nope:f"):
        main(trainer_stage(tiny, tmp_path, rewards=[{"fn": "grpo_core.nope:f"}]))


def test_empty_system_prompt_is_refused():
    with pytest.raises(ConfigError, match=r"system_prompt: is empty; omit it"):
        load_config(None, [a.removeprefix("--set=") for a in stage_args(runtime=dict(model="m"), system_prompt=" ")])
