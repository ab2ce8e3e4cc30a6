"""FSDP2 sharding of a policy (``parallelism = "fsdp2"``): each rank keeps 1/world of the
weights, gradients and AdamW state instead of DDP's full copy.

Layout: ``fully_shard`` on every decoder layer, then on a ``CompletionScorer`` around the model
as the root (embeddings, final norm and the LM head, tied or not, form the root's group). The
update calls the root, and FSDP gathers each layer's weights just before it runs and frees them
after. Every rank must then run the same sequence of layer calls (each is a collective): the root
scores with one full forward of prompt + completion (not the data-dependent chunks of
shared-prefix scoring), and a rank with fewer micro-batches runs zero-weighted ones to match
(``Trainer._update``). With ``precision = "bf16"`` FSDP's ``MixedPrecisionPolicy`` gathers bfloat16 weights and
reduces gradients in float32; the sharded master weights and AdamW state stay float32.

Rollouts, evaluation and the reference/old-policy scoring run the plain model on full weights:
``gathered`` all-gathers every group once (outside ``inference_mode``, so FSDP's reusable
unsharded tensors stay normal tensors), keeps them for the whole generation (no re-gather per
decode step) and frees them after. So generation runs on every rank, on its own prompts, with
the same code as an unsharded model; the price is one all-gather of the weights per forward-only
phase and a transient full copy of the weights in the compute dtype.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from grpo_core.config.checks import ConfigError
from grpo_core.policy.scoring import CompletionScorer


def decoder_layers(model) -> torch.nn.ModuleList:
    """The decoder blocks of a transformers causal LM (``model.model.layers``: Llama, Qwen2, ...)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not len(layers):
        raise ConfigError(f"parallelism = 'fsdp2' needs a causal LM with decoder layers at model.model.layers; "
                          f"{type(model).__name__} has none. Use parallelism = 'ddp'.")
    return layers


def shard(model, precision: str) -> FSDPModule:
    """Shard ``model`` in place across the default process group; returns the root to train
    through (a ``CompletionScorer``). ``model`` keeps its parameters' names; they become DTensors."""
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if precision == "bf16" \
        else MixedPrecisionPolicy()
    for layer in decoder_layers(model):
        fully_shard(layer, mp_policy=policy)
    root = fully_shard(CompletionScorer(model, shared_prefix=False), mp_policy=policy)
    # FSDP picks its root at the first forward; ``gathered`` runs the inner model, whose first
    # layer would otherwise claim that role, so the root is settled here
    root._get_fsdp_state()._lazy_init()
    return root


def fsdp_modules(root) -> list[FSDPModule]:
    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(root):
    """Full weights in every module of ``root`` for the duration: one all-gather per group, kept
    across forwards (generation calls each layer once per token), freed on exit."""
    modules = fsdp_modules(root)
    for m in modules:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
            m.set_reshard_after_forward(True, recurse=False)


def _state(root, opt) -> dict:
    return {"model": get_model_state_dict(root), "optim": get_optimizer_state_dict(root, opt)}


def save_state(root, opt, directory) -> None:
    """Every rank writes its shards of the weights and AdamW state into ``directory`` (rank 0 also
    the ``.metadata`` index): ``torch.distributed.checkpoint``, a collective. All ranks must see
    the same filesystem there (one node, or a volume shared by the nodes)."""
    dcp.save(_state(root, opt), checkpoint_id=str(directory))


def load_state(root, opt, directory) -> None:
    """Read what ``save_state`` wrote back into the sharded model and optimizer (a collective)."""
    state = _state(root, opt)
    dcp.load(state, checkpoint_id=str(directory))
    set_model_state_dict(root, state["model"])
    set_optimizer_state_dict(root, opt, state["optim"])


def full_state_dict(root) -> dict:
    """The unsharded weights under the model's own names (``root`` is the ``CompletionScorer``),
    on CPU in rank 0; other ranks get {}. A collective: every rank calls it. A tied weight (the
    LM head sharing the embeddings) comes back as a separate copy, so only its first name is
    kept: the saved dir then has the unsharded model's keys, and loading re-ties it."""
    full = get_model_state_dict(root, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    model = root.module
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    return {name: v for k, v in full.items() if (name := k.removeprefix("module.")) not in aliases}


def full_value(x):
    """A DTensor's full value (a collective: every rank calls it); anything else unchanged."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def local_bytes(tensors) -> int:
    """Bytes this rank holds for ``tensors`` (a DTensor counts its local shard only)."""
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total


def training_bytes(model, opt) -> dict:
    """This rank's parameter, gradient and optimizer-state bytes (what sharding divides)."""
    params = list(model.parameters())
    states = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
    return {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
            "optimizer": local_bytes(states)}
