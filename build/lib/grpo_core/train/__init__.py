"""One GRPO stage under torchrun: the trainer loop and its delegates (update parts, stage
checkpoints, metrics recorder, per-iteration metrics, promotion gate) and the entry point
`python -m grpo_core.train --config stage.json`.

May import every package below it: tracking, evaluation, policy, rollout, model, config, data,
io, algo."""
