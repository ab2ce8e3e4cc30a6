"""The config module against the code it configures."""


def test_config_choices_are_exactly_what_the_math_accepts():
    """config.py keeps its own copies (it validates before torch is imported, so it cannot import
    grpo_core.algorithm): a choice added on one side only would pass validation and fail at
    iteration 1, or be unreachable."""
    from grpo_core import algorithm, config, objective

    assert config.SCALES == algorithm.ADVANTAGE_SCALES == tuple(objective.SCALES)
    assert config.LOSS_TYPES == tuple(algorithm.LOSS_AGGREGATIONS)
