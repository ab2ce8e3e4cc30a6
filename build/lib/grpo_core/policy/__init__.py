"""The trained model and how it runs: `Policy` (load, LoRA, compile, DDP/FSDP2 wrapping, log-probs
with and without gradients, the reference's log-probs, engine sync, full state dict), padded and
packed scoring, sharding, and the torch.distributed helpers.

The only package that touches torch.distributed. May import rollout, model, config, data, io, algo."""
