"""What each Metaflow step does, kept out of the flow file: the run context and stage steps, the
evaluation step, the torchrun launcher, and the bootstrap SFT for models without a chat format.

The top of grpo_core: may import every package; only flows/ imports it."""
