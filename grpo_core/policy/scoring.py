"""Scoring sampled completions: per-token log-probs (and entropy) under a policy, for the loss.

``completion_logprobs`` scores with the *same* position ids the sampler used (``cumsum(mask) - 1``):
without them a left-padded batch is scored at shifted positions and the on-policy gradient
silently becomes off-policy. When the G rows of every group share one prompt, the prompt is run
once per group and its (differentiable) KV cache is shared by the G completions, and rows are
scored in length-sorted chunks that stop at each chunk's longest completion, so positions after
EOS cost (almost) nothing. Log-probs are taken at the sampling temperature, and only at the
completion positions. Where the model's logits are just its LM head's output (``chunked_head``),
the decoder stack runs alone and the head runs ``HEAD_CHUNK`` positions at a time, in forward and
backward (``algorithm.head_logprobs``): no [B, T, V] logits, nor their gradient, ever exist, and
at most one chunk's softmax waits for backward per scoring call. Where the model's layers are
mirrored by ``packed_scoring`` (Llama and Qwen2 layouts) and the head runs in chunks, shared
prompts are scored packed instead (``PACKED``): every prompt once and every completion up to its
EOS in one padding-free matrix, so each weight matmul is a single call over real tokens only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_core.algo.core import head_logprobs, token_entropy, token_logprobs
from grpo_core.model.loading import activation_checkpointing
from grpo_core.policy.packed_scoring import packed_hidden, packed_supported
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import cache_kwarg, prefill


def forward_inputs(batch: RolloutBatch, device):
    """Prompt + completion ids, mask and generate's position ids (``cumsum(mask) - 1``), each [B, P+T]."""
    ids = torch.cat([batch.prompt_ids, batch.completion_ids], 1).to(device)            # [B, P+T]
    attn = torch.cat([batch.prompt_mask, batch.completion_mask.long()], 1).to(device)  # [B, P+T]
    pos = (attn.cumsum(-1) - 1).clamp(min=0)                                           # as generate does
    return ids, attn, pos


def groups_share_prompts(batch: RolloutBatch) -> bool:
    """True when the G rows of every group hold the same prompt tokens and mask."""
    G = batch.group_size
    if len(batch) % G:
        return False
    ids = batch.prompt_ids.view(-1, G, batch.prompt_ids.shape[1])                      # [N, G, P]
    mask = batch.prompt_mask.view(-1, G, batch.prompt_mask.shape[1])
    return bool((ids == ids[:, :1]).all() and (mask == mask[:, :1]).all())


# One more scoring call (reference forward + policy forward and backward) costs about as much as
# this many more positions: measured 1.7 + 2.8 ms per call against 10 + 29 us per position (2-layer
# hidden-64 Llama, one CPU thread: ~115). Larger models make positions dearer and calls relatively
# cheaper, so this errs towards fewer chunks there.
SCORE_CALL_COST = 128


def length_chunks(lengths: list[int], call_cost: float | None = None) -> list[list[int]]:
    """Rows grouped so that each scoring call stops at its own longest completion.

    Positions after a row's EOS are masked out of the loss, yet a padded batch pays for them: with
    lengths spread from 1 to T that is a quarter to half of the work. Rows sorted longest first are
    cut into contiguous chunks minimising sum(rows x longest length) + ``call_cost`` per chunk, an
    exact dynamic programme over the runs of equal length (a cut inside a run never helps).
    Returns row indices per chunk, longest chunk first. ``call_cost`` defaults to ``SCORE_CALL_COST``.
    """
    call_cost = SCORE_CALL_COST if call_cost is None else call_cost
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    runs = []                                                                # (first sorted index, length)
    for k, i in enumerate(order):
        if not runs or lengths[i] != runs[-1][1]:
            runs.append((k, lengths[i]))
    ends = [k for k, _ in runs[1:]] + [len(order)]
    best, cut = [0.0] + [float("inf")] * len(runs), [0] * (len(runs) + 1)   # best[j]: runs[:j] covered
    for j in range(1, len(runs) + 1):
        for i in range(j):
            cost = best[i] + (ends[j - 1] - runs[i][0]) * runs[i][1] + call_cost
            if cost < best[j]:
                best[j], cut[j] = cost, i
    bounds, j = [], len(runs)
    while j:
        bounds.append((runs[cut[j]][0], ends[j - 1]))
        j = cut[j]
    return [order[a:b] for a, b in reversed(bounds)]


def _shared_prefix_outputs(model, batch: RolloutBatch, device, decoder=None):
    """Completion-position outputs in pieces: [(rows [b] or None for all rows, out [b, L, .])], L =
    the piece's longest completion (EOS included); each prompt run once, its KV cache shared by its
    G rows. ``out`` is the model's logits [b, L, V], or with ``decoder`` (the model's own decoder
    stack) its final hidden states [b, L, H], for the LM head to run in chunks.

    The cache keeps its autograd graph, so gradients reach the prompt positions as in a full
    forward. Same positions and mask as ``forward_inputs``, so the outputs at every position up
    to a row's EOS equal the full forward's up to float rounding; later positions are not computed.
    """
    G, P = batch.group_size, batch.prompt_ids.shape[1]
    ids, mask = batch.prompt_ids[::G].to(device).contiguous(), batch.prompt_mask[::G].to(device).contiguous()
    call = model if decoder is None else decoder
    out, prefix = prefill(call, ids, mask, 1 if decoder is None else None)
    first = (out.logits if decoder is None else out.last_hidden_state)[:, -1:]         # [N, 1, V or H]
    # Repeated G times first, then rows picked: the backward of a pick with repeated indices
    # (row // G) accumulates in a thread-dependent order; of unique ones, it does not (bitwise resume).
    prefix.batch_repeat_interleave(G)
    first = first.repeat_interleave(G, 0)                                              # [B, 1, .]
    _, attn, pos = forward_inputs(batch, device)
    ids = batch.completion_ids.to(device)  # picked by device indices below: CUDA refuses a CPU tensor
    lengths = batch.completion_mask.sum(-1).clamp(min=1).tolist()
    chunks, pieces = length_chunks(lengths), []
    for chunk in chunks:
        L = max(lengths[i] for i in chunk)
        if len(chunks) == 1:  # every row, in batch order: nothing to pick
            rows, pick, cache = None, slice(None), prefix
        else:
            rows = pick = torch.tensor(sorted(chunk), device=device)                   # [b]
            cache = type(prefix)(config=model.config)
            for i, layer in enumerate(prefix.layers):
                cache.update(layer.keys[pick], layer.values[pick], i)
        out = first[pick]                                                              # [b, 1, .]
        if L > 1:
            inputs = dict(input_ids=ids[pick, :L - 1], attention_mask=attn[pick, :P + L - 1],
                          position_ids=pos[pick, P:P + L - 1])  # contiguous: a compiled scorer guards on strides
            inputs = {k: v.to(device).contiguous() for k, v in inputs.items()}
            rest = call(**inputs, use_cache=True, **{cache_kwarg(call): cache})
            out = torch.cat([out, rest.logits if decoder is None else rest.last_hidden_state], 1)  # [b, L, .]
        pieces.append((rows, out))
    return pieces


def _full_forward_outputs(model, batch: RolloutBatch, device, decoder=None):
    """One forward of prompt + completion: the model's logits [B, T, V] at the positions that
    predict the completion tokens, or with ``decoder`` its final hidden states there [B, T, H]."""
    T = batch.completion_ids.shape[1]
    ids, attn, pos = forward_inputs(batch, device)
    if decoder is None:
        return model(input_ids=ids, attention_mask=attn, position_ids=pos, logits_to_keep=T + 1,
                     use_cache=False).logits[:, :-1]
    return decoder(input_ids=ids, attention_mask=attn, position_ids=pos,
                   use_cache=False).last_hidden_state[:, -T - 1:-1]


# LM-head positions per chunk (``algorithm.head_logprobs``); 0: the model's own head, whose logits
# [B, T, V] exist whole (and their gradient too, in the update)
HEAD_CHUNK = 1024
# Model types whose logits are exactly ``lm_head(final hidden states)``: no scale, no soft-capping
HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# Score grouped completions packed, without padding (``packed_scoring``), where the model allows
PACKED = True


def chunked_head(model):
    """(decoder stack, LM head ``nn.Linear``) when the head can run in chunks outside the model,
    else None: head chunks off, a compiled scorer (its graph is the whole model), or a model
    whose logits are not just the head's output (soft-capping, scaling, an adapter on the head)."""
    if not HEAD_CHUNK or hasattr(model, "_orig_mod"):
        return None
    if getattr(getattr(model, "config", None), "model_type", None) not in HEAD_MODEL_TYPES:
        return None
    head, decoder = model.get_output_embeddings(), model.get_decoder()
    if type(head) is not torch.nn.Linear or decoder is None or decoder is model:
        return None
    return decoder, head


def _head_dtype(hidden: torch.Tensor):
    """The dtype an autocast forward would run the head's matmul in (None: hidden's own)."""
    kind = hidden.device.type
    if hidden.dtype == torch.float64 or not torch.is_autocast_enabled(kind):
        return None
    return torch.get_autocast_dtype(kind)


def _packed_logprobs(model, head, batch: RolloutBatch, temperature: float, with_entropy: bool, device,
                     checkpointed: bool = False):
    """``completion_logprobs`` through ``packed_scoring``: no padding, prompts in the same matmuls;
    ``checkpointed``: its layers recomputed in backward."""
    hidden, targets, slots = packed_hidden(model, batch, device, checkpointed)        # [S, H], [S], [B, W]
    lp, en = head_logprobs(hidden[None], head.weight, targets[None], temperature, bias=head.bias,
                           chunk_size=HEAD_CHUNK, compute_dtype=_head_dtype(hidden), with_entropy=with_entropy)
    B, T = batch.completion_ids.shape
    width = max(T, slots.shape[1])
    slots = F.pad(slots, (0, width - slots.shape[1]))

    def unpack(values):  # [1, S] -> [B, T], zeros after each row's EOS
        return values.new_zeros(B, width).masked_scatter(slots, values[0])[:, :T]

    return unpack(lp), (unpack(en) if with_entropy else None)


class CompletionScorer(torch.nn.Module):
    """``completion_logprobs`` of a policy as one module call, for DDP to wrap.

    DDP allows exactly one forward per backward and hooks only its wrapped module's forward, while
    shared-prefix scoring calls the model twice (the prompts once per group, then the completions
    on the repeated cache), or, packed, calls the layers' submodules without the model's forward
    at all. Wrapping this module instead of the bare model makes either one DDP forward, so
    multi-rank training keeps the saving. Parameters are the model's own; checkpoints and saved
    models use ``models.unwrap``.

    ``shared_prefix=False`` always takes the full forward, one model call whatever the batch:
    FSDP gathers and reduces per layer call, so every rank must call each layer equally often,
    while shared-prefix scoring calls the model once per length chunk of the rank's own data.
    """

    def __init__(self, model, shared_prefix: bool = True):
        super().__init__()
        self.module = model  # named as DDP names it, so ``models.unwrap`` strips both layers
        self.shared_prefix = shared_prefix

    def forward(self, batch: RolloutBatch, temperature: float, with_entropy: bool = False):
        return completion_logprobs(self.module, batch, temperature, with_entropy, self.shared_prefix)


def _fsdp_sharded(model) -> bool:
    """Whether FSDP2 shards any of ``model``'s modules (their weights are gathered by hooks that a
    replayed packed layer would not run)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without distributed
        return False
    return any(isinstance(m, FSDPModule) for m in model.modules())


def _replays_layers(model) -> bool:
    """True when this forward will be recomputed layer by layer in backward (gradient checkpointing
    in training mode with grad on). transformers' checkpointed layers then drop the KV cache
    argument (or would write it twice on replay), so the shared prompt cache cannot be used."""
    return activation_checkpointing(model) and model.training and torch.is_grad_enabled()


def completion_logprobs(model, batch: RolloutBatch, temperature: float, with_entropy: bool = False,
                        shared_prefix: bool = True):
    """Per-token log-probs of the completion tokens [B, T] (and entropy [B, T] if asked).

    Positions after a row's EOS (``completion_mask`` False) may be skipped and hold 0: mask them,
    as the loss does.

    ``model``: a causal LM, or DDP around a ``CompletionScorer`` (shared-prefix scoring, one DDP
    forward) or around a bare LM (the full forward: the one forward DDP allows), or a
    ``CompletionScorer`` that FSDP shards (``sharding.shard``).
    """
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    if isinstance(model, CompletionScorer) or (ddp and isinstance(model.module, CompletionScorer)):
        return model(batch, temperature, with_entropy)  # DDP's or FSDP's root around the scorer
    device = next(model.parameters()).device
    T, targets = batch.completion_ids.shape[1], batch.completion_ids.to(device)
    decoder, head = (None, None) if ddp else (chunked_head(model) or (None, None))  # DDP: its own forward
    shared = shared_prefix and groups_share_prompts(batch) and not ddp
    replay = _replays_layers(model)
    if shared and head is not None and PACKED and packed_supported(model) and not (replay and _fsdp_sharded(model)):
        return _packed_logprobs(model, head, batch, temperature, with_entropy, device, checkpointed=replay)
    shared = shared and not replay  # the model's forward, replayed per layer, cannot share the prompt's cache
    if shared:
        pieces = _shared_prefix_outputs(model, batch, device, decoder)                 # [(rows, [b, L, .])]
    else:
        pieces = [(None, _full_forward_outputs(model, batch, device, decoder))]        # [(None, [B, T, .])]
    logp, ent = [], []
    for i, (rows, out) in enumerate(pieces):
        pad, pick = (0, T - out.shape[1]), slice(None) if rows is None else rows
        tgt = targets[pick, :out.shape[1]]
        if head is not None:  # one piece keeps its last chunk's softmax for backward: one chunk in all
            lp, en = head_logprobs(out, head.weight, tgt, temperature, bias=head.bias, chunk_size=HEAD_CHUNK,
                                   compute_dtype=_head_dtype(out), with_entropy=with_entropy,
                                   keep_last=i == len(pieces) - 1)
        else:
            lp = token_logprobs(out, tgt, temperature)
            en = token_entropy(out.detach(), temperature) if with_entropy else None
        logp.append(F.pad(lp, pad))
        if with_entropy:
            ent.append(F.pad(en, pad))
    if len(pieces) == 1:
        return logp[0], (ent[0] if with_entropy else None)
    order = torch.cat([rows for rows, _ in pieces]).argsort()                          # back to batch order
    return torch.cat(logp)[order], (torch.cat(ent)[order] if with_entropy else None)   # [B, T]
