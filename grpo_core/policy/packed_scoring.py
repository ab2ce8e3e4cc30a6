"""Padding-free scoring of grouped completions: every real token in one packed matrix.

Shared-prefix scoring through the model's own forward (``scoring._shared_prefix_outputs``) runs
each group's prompt as its own call and the completions as another, padded to the longest. On a
real model the weight matmuls are the cost, and that layout pays for them three times over:
positions after a row's EOS (padding) go through every layer; the prompts' matmuls have a few
dozen rows, far below the rate of the completions' hundreds; and every weight's gradient is
computed twice (prompt and completions) and then summed.

Here the decoder layers run on a packed [M, H] matrix holding each group's prompt tokens once
and each completion's tokens up to its EOS, nothing else: every projection and MLP matmul is one
call over all M rows. Attention alone needs the per-row layout; it runs on padded views gathered
from the packed rows, each completion attending to its group's prompt and to its own earlier
tokens, at the positions the sampler used. The math is the model's (the layers' own modules,
its rotary embedding and RMSNorm); only the order of additions differs, so values agree with
the full forward to float rounding (tests compare in float64).

Supports transformers' own Llama and Qwen2 layers under the conditions the decode loop mirrors
(SDPA, full attention, no attention dropout while training; ``packed_supported``); scoring falls
back to the model's forward otherwise. The layers' submodules are called directly, not the
layers' forward: under FSDP2 that is right only inside ``sharding.gathered`` (the trainer's
forward-only scoring), since the layers' pre-forward hooks, which gather the weights, do not run.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import _signed_sin, fast_decode_supported


def _mirrored_classes():
    """(model, decoder layer, attention) classes whose forward ``packed_hidden`` restates."""
    from transformers.models.llama import modeling_llama as llama
    from transformers.models.qwen2 import modeling_qwen2 as qwen2

    return ((llama.LlamaModel, llama.LlamaDecoderLayer, llama.LlamaAttention),
            (qwen2.Qwen2Model, qwen2.Qwen2DecoderLayer, qwen2.Qwen2Attention))


def packed_supported(model) -> bool:
    """Whether ``packed_hidden`` computes this model's final hidden states: the conditions the
    decode loop mirrors (``decode.fast_decode_supported``: SDPA, full attention, SiLU MLP, no
    q/k norms, no attention dropout while training) and, since a wrong score here is a wrong
    gradient, transformers' own model, layer and attention forwards (subclasses that only add
    hooks, as FSDP2's do, keep them), not a remote-code class under the same model type."""
    if not fast_decode_supported(model):
        return False
    inner = model.model
    forwards = (type(inner).forward, type(inner.layers[0]).forward, type(inner.layers[0].self_attn).forward)
    return any(forwards == tuple(cls.forward for cls in classes) for classes in _mirrored_classes()) and all(
        type(layer).forward is forwards[1] and type(layer.self_attn).forward is forwards[2] for layer in inner.layers)


def _rotate(x, cos, signed_sin):
    """transformers' ``x * cos + rotate_half(x) * sin`` for x [m, heads, D], cos [m, D] and
    ``decode._signed_sin(sin)``, as the decode loop rotates: ``roll(x, D/2) * signed sin``."""
    return x * cos[:, None] + x.roll(x.shape[-1] // 2, -1) * signed_sin[:, None]


class _Slots:
    """A padded [R, S] view of packed rows: ``valid`` [R, S] marks the real slots and ``index``
    [m] holds their flat positions, in row-major order. Index ops, not boolean masks: a mask
    index costs a device-to-host sync per call on GPU, and these run several times per layer.
    Every index is unique, so backward accumulates in a fixed order (bitwise-repeatable)."""

    def __init__(self, valid: torch.Tensor):
        self.valid, self.index = valid, valid.flatten().nonzero().squeeze(1)

    def pad(self, x):
        """Packed x [m, ...] -> [R, S, ...], zeros in the empty slots."""
        out = x.new_zeros(self.valid.numel(), *x.shape[1:]).index_copy(0, self.index, x)
        return out.view(*self.valid.shape, *x.shape[1:])

    def pack(self, x):
        """Padded x [R, S, ...] -> its real slots [m, ...]."""
        return x.flatten(0, 1).index_select(0, self.index)


class _Layout:
    """Where each token of a micro-batch of groups sits: packed rows, padded views and masks.

    Packed order: the prompts' real tokens, group by group, then each completion row's input
    tokens (its first ``length - 1``: the last token is only a target), row by row.
    """

    def __init__(self, batch: RolloutBatch, device):
        self.group_size = G = batch.group_size
        prompt_ids, prompt_pos, prompt_lengths = self._prompts(batch, device)
        lengths = batch.completion_mask.sum(-1).clamp(min=1).to(device)                   # [B] EOS included
        slots = torch.arange(max(int(lengths.max()) - 1, 1), device=device)              # [Lq]
        Lq = len(slots)
        self.completions = _Slots(slots < (lengths - 1)[:, None])                         # [B, Lq]
        comp_ids = self.completions.pack(batch.completion_ids.to(device)[:, :Lq])
        comp_pos = self.completions.pack(prompt_lengths.repeat_interleave(G)[:, None] + slots)
        self.ids, self.positions = torch.cat([prompt_ids, comp_ids]), torch.cat([prompt_pos, comp_pos])  # [M]
        self.n_prompt = len(prompt_ids)
        own = (slots[:, None] >= slots[None, :])[None] & self.completions.valid[:, None, :]     # [B, Lq, Lq]
        prompt_keys = self.prompts.valid.repeat_interleave(G, 0)[:, None, :].expand(-1, Lq, -1)
        self.completion_attn = torch.cat([prompt_keys, own], -1)[:, None]                 # [B, 1, Lq, Pm+Lq]
        # each row's targets: its first token is predicted by its prompt's last state, the rest by its inputs
        self.last_prompt = prompt_lengths.cumsum(0) - 1                                   # [n] packed index
        self.targets = _Slots(torch.arange(Lq + 1, device=device) < lengths[:, None])     # [B, Lq+1]

    def _prompts(self, batch: RolloutBatch, device):
        """Each group's real prompt tokens, packed, their positions and the groups' prompt lengths;
        sets ``prompts`` (the padded view) and ``prompt_attn`` (causal over real tokens)."""
        mask = batch.prompt_mask[::self.group_size].bool().to(device)                     # [n, P]
        lengths = mask.sum(-1)                                                            # [n]
        if not bool(lengths.all()):
            raise ValueError("a group's prompt has no tokens (prompt_mask all 0): every prompt needs at least one")
        slots = torch.arange(int(lengths.max()), device=device)
        self.prompts = _Slots(slots < lengths[:, None])                                   # [n, Pm]
        causal = slots[:, None] >= slots[None, :]                                         # [Pm, Pm]
        self.prompt_attn = (causal[None] & self.prompts.valid[:, None, :])[:, None]       # [n, 1, Pm, Pm]
        ids = batch.prompt_ids[::self.group_size].to(device)[mask]  # real tokens in order, any padding side
        return ids, self.prompts.pack(slots.expand_as(self.prompts.valid)), lengths


def _attention(attn, q, k, v, layout: _Layout):
    """Self-attention output [M, heads*D] of packed q [M, nh, D], k/v [M, nkv, D]: each prompt
    causally over itself, each completion over its group's prompt and causally over itself."""
    G, P = layout.group_size, layout.n_prompt
    rep = q.shape[1] // k.shape[1]
    qp, kp, vp = (layout.prompts.pad(t[:P]).transpose(1, 2) for t in (q, k, v))          # [n, h, Pm, D]
    qc, kc, vc = (layout.completions.pad(t[P:]).transpose(1, 2) for t in (q, k, v))      # [B, h, Lq, D]

    def with_prompt(prompt, own):  # each group's prompt keys/values ahead of its G rows' own
        n = prompt.shape[0]
        shared = prompt[:, None].expand(n, G, *prompt.shape[1:]).reshape(n * G, *prompt.shape[1:])
        return torch.cat([shared, own], 2)                                                # [B, h, Pm+Lq, D]

    keys, values = with_prompt(kp, kc), with_prompt(vp, vc)
    # grouped-query attention: on CPU SDPA takes the KV heads as they are (the same values as
    # transformers' repeat_kv, without saving repeated copies for backward: -0.5 GB of saved
    # activations for SmolLM2's whole batch); CUDA's masked kernels need them repeated
    gqa = {"enable_gqa": True} if rep > 1 and q.device.type == "cpu" else {}
    if rep > 1 and not gqa:
        kp, vp, keys, values = (t.repeat_interleave(rep, 1) for t in (kp, vp, keys, values))
    op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=layout.prompt_attn, scale=attn.scaling, **gqa)
    oc = F.scaled_dot_product_attention(qc, keys, values, attn_mask=layout.completion_attn, scale=attn.scaling, **gqa)
    packed = torch.cat([layout.prompts.pack(op.transpose(1, 2)), layout.completions.pack(oc.transpose(1, 2))])
    return packed.flatten(1)                                                              # [M, nh*D]


def _layer(layer, x, cos, sin, layout: _Layout):
    """One decoder layer on the packed rows x [M, H]."""
    attn = layer.self_attn
    h = layer.input_layernorm(x)
    D = attn.head_dim
    q = _rotate(attn.q_proj(h).view(len(h), -1, D), cos, sin)
    k = _rotate(attn.k_proj(h).view(len(h), -1, D), cos, sin)
    v = attn.v_proj(h).view(len(h), -1, D)
    x = x + attn.o_proj(_attention(attn, q, k, v, layout))
    return x + layer.mlp(layer.post_attention_layernorm(x))


def packed_hidden(model, batch: RolloutBatch, device, checkpointed: bool = False
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(hidden [S, H], targets [S], target_slots [B, W]): the final hidden states at the positions
    that predict each completion token up to its EOS, those tokens, and their slots in the
    completion (True at t < the row's length; W its longest; S its True count; row-major).
    The batch's G rows of each group must share their prompt. ``checkpointed``: each layer keeps
    only its input for backward and runs again there (activation checkpointing, as transformers'
    gradient checkpointing does for the model's own forward; not for FSDP2-sharded layers, whose
    weights the replay would not gather)."""
    from torch.utils.checkpoint import checkpoint

    inner, layout = model.model, _Layout(batch, device)
    x = inner.embed_tokens(layout.ids)                                                    # [M, H]
    cos, sin = inner.rotary_emb(x[None], layout.positions[None])
    cos, sin = cos[0], _signed_sin(sin[0])                                                # [M, D]
    for layer in inner.layers:
        x = (checkpoint(_layer, layer, x, cos, sin, layout, use_reentrant=False) if checkpointed
             else _layer(layer, x, cos, sin, layout))
    x = inner.norm(x)
    last = x[layout.last_prompt]                                                          # [n, H]
    first = last[:, None].expand(-1, layout.group_size, -1).reshape(-1, 1, last.shape[-1])  # [B, 1, H]
    rest = layout.completions.pad(x[layout.n_prompt:])                                    # [B, Lq, H]
    hidden = layout.targets.pack(torch.cat([first, rest], 1))                             # [S, H]
    W = layout.targets.valid.shape[1]
    ids = batch.completion_ids.to(device)
    ids = F.pad(ids, (0, max(W - ids.shape[1], 0)))[:, :W]
    return hidden, layout.targets.pack(ids), layout.targets.valid
