"""grpo_core: GRPO post-training with verifiable rewards, on torch + transformers.

Sub-packages, bottom floor first (each imports only from floors below it; docs/architecture.md
has the map): ``io`` and ``algo`` -> ``data`` -> ``config`` -> ``model`` -> ``rollout`` ->
``policy`` -> ``evaluation`` -> ``tracking`` -> ``train`` -> ``pipeline``. The public math API is
re-exported here.
"""
from grpo_core.algo.core import group_advantages, informative_mask, k3_kl, token_logprobs
from grpo_core.algo.losses import grpo_loss

__all__ = ["group_advantages", "grpo_loss", "informative_mask", "k3_kl", "token_logprobs"]
__version__ = "0.1.0"
