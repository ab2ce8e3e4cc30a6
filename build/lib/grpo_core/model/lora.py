"""LoRA policies through peft: adapters injected into the policy in place, the reference as the
same module with its adapters off, and the merged model for publication.

``attach`` injects the adapters into the transformers model itself (peft's ``get_peft_model``
wraps it, but the trainer, the decoder and the scorer keep working on the model they know), freezes
every base weight and returns the peft handle. The adapters start at zero (peft's ``lora_B`` init),
so at step 0 the policy equals the reference bit for bit and the k3 KL is exactly 0. A checkpoint
holds what trains (``checkpoint.trained_weights``); the stage's final model is merged into plain
linear layers and loads without peft.
"""
from __future__ import annotations

import contextlib

import torch

from grpo_core.config.checks import ConfigError
from grpo_core.config.groups import LoraSettings


def attach(model, settings: LoraSettings, where: str):
    """Inject LoRA adapters into ``model`` (in place) and return the peft model around it.
    Target modules that match nothing are a ConfigError naming the field."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=settings.target_modules, bias="none", task_type="CAUSAL_LM")
    try:
        peft_model = get_peft_model(model, config)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
        raise ConfigError(f"{where}.lora.target_modules = {settings.target_modules!r}: {exc} Use names of "
                          "this model's linear layers (e.g. q_proj, v_proj) or \"all-linear\".") from exc
    if peft_model.get_base_model() is not model:  # the trainer holds ``model``: it must be the one adapted
        raise RuntimeError("peft returned a copy of the model instead of adapting it in place")
    return peft_model


def reference_mode(peft_model):
    """A context in which the policy computes the reference: every adapter off."""
    return peft_model.disable_adapter() if peft_model is not None else contextlib.nullcontext()


def merged(peft_model):
    """The base model with the adapters folded into its weights and peft's layers removed: a plain
    transformers model (the policy's training state is gone afterwards)."""
    return peft_model.merge_and_unload()


def adapter_count(model) -> tuple[int, int]:
    """(trained parameters, all parameters) of ``model``."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def _active_adapters(module) -> tuple[torch.nn.Linear, list[str]]:
    """The plain linear layer under ``module`` and the adapters whose deltas add to it; ValueError
    for a layer whose output is not ``x @ W.T + b`` (adapter dropout while training, DoRA, other
    adapter kinds or wrappers)."""
    if type(module) is torch.nn.Linear:
        return module, []
    base = getattr(module, "base_layer", None)
    if type(base) is not torch.nn.Linear or not hasattr(module, "get_delta_weight"):
        raise ValueError(f"{type(module).__name__} is not a linear map the decoder can mirror")
    if module.merged or module.disable_adapters:
        return base, []
    names = [n for n in module.active_adapters if n in module.lora_A]
    for name in names:
        dropout = module.lora_dropout[name]
        if (module.training and isinstance(dropout, torch.nn.Dropout) and dropout.p) or module.use_dora.get(name):
            raise ValueError("adapter dropout while training, or DoRA, is not a fixed linear map")
    return base, names


def is_linear_map(module) -> bool:
    """Whether ``linear_weights`` describes what ``module`` computes."""
    try:
        _active_adapters(module)
    except ValueError:
        return False
    return True


def linear_weights(module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) that ``module`` applies as ``x @ weight.T + bias``: a plain ``nn.Linear``'s, or
    a peft LoRA layer's base weight plus its active adapters' deltas, computed here and never
    written back, so the base weights (the reference) stay exact."""
    base, names = _active_adapters(module)
    weight = base.weight
    for name in names:
        weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight, base.bias
