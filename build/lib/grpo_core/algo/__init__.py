"""The GRPO math, pure: group advantages, the k3 KL estimator, token log-probs from logits, the loss
entries (one per loss type) and the objective card that records which one a stage used.

Imports nothing of grpo_core's and nothing but torch, so every formula is testable by itself
against hand-computed values and a float64 reference."""
