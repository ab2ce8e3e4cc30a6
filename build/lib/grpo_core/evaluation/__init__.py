"""Measuring a model: greedy and sampled accuracy on named sets, paired statistics (McNemar,
sign-flip permutation, Wilson, Welch) and the health alarms of a training curve.

`python -m grpo_core.evaluation --model DIR --set NAME` evaluates one model. May import policy,
rollout, model, config, data, io, algo."""
