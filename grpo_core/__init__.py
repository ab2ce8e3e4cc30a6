"""grpo_core: GRPO post-training with verifiable rewards, on torch + transformers.

Layers (each its own module): pure math (``algorithm``, ``losses``), rewards (``rewards``), data
(``data``), rollout (``rollout``), the trainer loop (``trainer``, entry ``train``), distributed
helpers (``dist``), storage (``storage``, ``checkpoint``), tracking and registry adapters
(``tracking``, ``registry``). The public math API is re-exported here.
"""
from grpo_core.algorithm import group_advantages, informative_mask, k3_kl, token_logprobs
from grpo_core.losses import grpo_loss

__all__ = ["group_advantages", "grpo_loss", "informative_mask", "k3_kl", "token_logprobs"]
__version__ = "0.1.0"
