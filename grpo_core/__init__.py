"""grpo_core: GRPO post-training with verifiable rewards, on torch + transformers.

Layers (each its own module): pure math (``algorithm``), rewards (``rewards``), data
(``data``), rollout (``rollout``), the trainer loop (``trainer``, entry ``train``), distributed
helpers (``dist``), storage (``storage``, ``checkpoint``), tracking and registry adapters
(``tracking``, ``registry``). The public math API is re-exported here.
"""
from grpo_core.algorithm import group_advantages, grpo_loss, informative_mask, k3_kl, token_logprobs

__all__ = ["group_advantages", "grpo_loss", "informative_mask", "k3_kl", "token_logprobs"]
__version__ = "0.1.0"
