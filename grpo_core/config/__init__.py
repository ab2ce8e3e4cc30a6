"""Configuration: one typed config per stage (`stage.GRPOConfig` and its groups), the pipeline
config that a flow file holds (with `evaluation.EvalConfig`, its per-task evaluation tables),
the shared checks whose errors name the dotted field and the fix,
the stage table, and the generated reference (`python -m grpo_core.config.reference`).

May import data (task names and params), io and algo (loss names); nothing above."""
