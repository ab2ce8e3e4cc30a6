"""MLflow, and only here: runs and their tags, the outage-safe buffered logger, the model registry
(champion/challenger by a paired test; `python -m grpo_core.tracking.registry compare`) and the
served pyfunc model.

May import evaluation (statistics), rollout (loop rules), config, io; nothing above."""
