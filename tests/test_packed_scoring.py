"""Padding-free scoring (``packed_scoring``, ``scoring.PACKED``): the same log-probs, entropy and
parameter gradients as the padded shared-prefix pieces and as one full forward of each row."""
import pytest
import torch

import grpo_core.policy.scoring as scoring
from grpo_core.config.groups import LoraSettings
from grpo_core.model import lora
from grpo_core.model.loading import enable_activation_checkpointing
from grpo_core.policy import packed_scoring
from grpo_core.policy.scoring import completion_logprobs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import sample_shared_prefix
from grpo_core.rollout.generate import completion_mask
from tests.test_fast_rollout import LINEAR_ROPE, PROMPTS, _model, _prompts


def _batch(model, tok, G=3, max_new_tokens=9, early=((0, 5), (3, 1), (4, 7))):
    """Sampled completions of PROMPTS (left-padded, three prompt lengths), some cut short: rows of
    every length from 1 to ``max_new_tokens``."""
    ids, mask = _prompts(tok, PROMPTS)
    comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=max_new_tokens, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id).clone()
    cmask, trunc = completion_mask(comp, tok.eos_token_id)
    for row, length in early:
        cmask[row, length:] = False
    return RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask, trunc, G, [], [])


def _scored(model, batch, packed, monkeypatch, shared_prefix=True, temperature=0.8):
    monkeypatch.setattr(scoring, "PACKED", packed)
    model.zero_grad()
    logp, ent = completion_logprobs(model, batch, temperature, with_entropy=True, shared_prefix=shared_prefix)
    upstream = torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)  # every position its own weight
    (logp * upstream * batch.completion_mask).sum().backward()
    return logp.detach(), ent, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(got, want, m, atol, rtol=1e-8):
    """Log-probs and entropy within ``atol`` absolute; every gradient within atol + rtol x |want|."""
    for a, b in ((got[0][m], want[0][m]), (got[1][m], want[1][m])):
        assert torch.allclose(a, b, atol=atol, rtol=0), (a - b).abs().max()
    assert got[2].keys() == want[2].keys() and len(got[2]) > 0
    for name in want[2]:
        assert torch.allclose(got[2][name], want[2][name], atol=atol, rtol=rtol), name


@pytest.mark.parametrize("arch,kv_heads,rope", [("llama", None, None), ("qwen2", None, None),
                                                ("llama", 2, None), ("llama", None, LINEAR_ROPE)])
def test_packed_scoring_equals_padded_pieces_and_full_forward_in_float64(monkeypatch, arch, kv_heads, rope):
    """Qwen2's q/k/v biases, grouped-query attention and a scaled rotary embedding included: in
    float64, packed scoring gives what the padded pieces and the full forward give, at every
    scored position and for every parameter's gradient (tied embeddings: head and input both).
    The padded pieces run the same shared-prefix math through the model's own forward and agree
    to float64 rounding; transformers' full forward of each row differs from both by up to ~1e-6
    relative in some gradients (log-probs agree to 1e-10), so that comparison allows 1e-5."""
    model, tok = _model(arch, kv_heads=kv_heads, rope=rope)
    batch = _batch(model, tok)
    model = model.double().train()
    assert packed_scoring.packed_supported(model)
    calls = []
    real = packed_scoring.packed_hidden
    monkeypatch.setattr(scoring, "packed_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))
    packed = _scored(model, batch, True, monkeypatch)
    assert calls == [1]
    pieces = _scored(model, batch, False, monkeypatch)
    full = _scored(model, batch, True, monkeypatch, shared_prefix=False)
    assert calls == [1]  # only the packed run took the packed path
    m = batch.completion_mask
    assert set(m.sum(-1).tolist()) >= {1, 5, 7, 9}  # rows of one token up to the longest
    _assert_same(packed, pieces, m, atol=1e-10)
    _assert_same(packed, full, m, atol=1e-6, rtol=1e-5)
    assert torch.allclose(packed[0][m], full[0][m], atol=1e-10, rtol=0)
    assert (packed[0][~m] == 0).all() and (packed[1][~m] == 0).all()  # after EOS: nothing scored
    assert packed[0].dtype == packed[1].dtype == torch.float64


def test_packed_scoring_of_one_token_completions(monkeypatch):
    """Every row EOS at its first token: no completion token enters a layer, and each row's
    log-prob comes from its prompt's last position."""
    model, tok = _model()
    batch = _batch(model, tok, G=2, max_new_tokens=1, early=())
    model = model.double().train()
    m = batch.completion_mask
    assert batch.completion_ids.shape[1] == 1 and m.all()
    _assert_same(_scored(model, batch, True, monkeypatch), _scored(model, batch, False, monkeypatch), m, atol=1e-10)


def test_packed_gradients_are_bitwise_repeatable(monkeypatch):
    """Two backward passes over the same batch give identical gradients: the packed layout's
    gathers and scatters use unique indices (a repeated index accumulates in a thread-dependent
    order), which keeps resumed runs bitwise equal."""
    model, tok = _model()
    batch = _batch(model, tok)
    model.train()
    first, second = _scored(model, batch, True, monkeypatch), _scored(model, batch, True, monkeypatch)
    assert torch.equal(first[0], second[0])
    for name in first[2]:
        assert torch.equal(first[2][name], second[2][name]), name


def test_packed_scoring_under_bf16_autocast_is_as_close_to_float32_as_the_padded_pieces(monkeypatch):
    """precision = "bf16": under CPU autocast both paths run their matmuls in bf16. Against the
    float32 scores, packed scoring is no further off than the padded pieces (a dtype slip, such as
    rotating in bf16, would double its error), and the bf16 runs do differ from float32."""
    model, tok = _model()
    batch = _batch(model, tok)
    model.train()
    m = batch.completion_mask
    exact = _scored(model, batch, True, monkeypatch)
    errors = {}
    for packed in (True, False):
        monkeypatch.setattr(scoring, "PACKED", packed)
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logp, _ = completion_logprobs(model, batch, 0.8)
        upstream = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        (logp * upstream * m).sum().backward()
        assert logp.dtype == torch.float32
        grads = {n: p.grad for n, p in model.named_parameters()}
        errors[packed] = ((logp.detach() - exact[0])[m].abs().mean().item(),
                          max(((grads[n] - g).norm() / g.norm()).item() for n, g in exact[2].items()))
    assert errors[False][0] > 1e-4  # bf16 did run
    for packed_error, padded_error in zip(errors[True], errors[False]):
        assert packed_error <= 2 * padded_error, errors


def test_packed_scoring_with_lora_adapters_on_and_off(monkeypatch):
    """A LoRA policy (adapters injected in place, as the trainer holds it): packed scoring goes
    through the adapted layers, equals the padded pieces with adapters on, and with them off
    (the reference) equals the base model's scores."""
    model, tok = _model()
    batch = _batch(model, tok)
    base = _scored(model.double().train(), batch, True, monkeypatch)
    peft_model = lora.attach(model, LoraSettings(rank=4, alpha=8.0, target_modules="all-linear"), "test")
    with torch.no_grad():  # non-zero adapters: peft starts B at zero
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    assert packed_scoring.packed_supported(model)
    m = batch.completion_mask
    _assert_same(_scored(model, batch, True, monkeypatch), _scored(model, batch, False, monkeypatch), m, atol=1e-10)
    with lora.reference_mode(peft_model), torch.no_grad():
        monkeypatch.setattr(scoring, "PACKED", True)
        off, _ = completion_logprobs(model, batch, 0.8)
    assert torch.allclose(off[m], base[0][m], atol=1e-10)
    assert not torch.allclose(_scored(model, batch, True, monkeypatch)[0][m], base[0][m], atol=1e-4)


def test_packed_scoring_is_taken_only_where_it_mirrors_the_model(monkeypatch):
    """Packed scoring runs for shared prompts on a mirrored model with the head in chunks, also
    with its layers replayed in backward (activation checkpointing) unless FSDP2 shards them;
    eager attention, the model's own head, PACKED off and prompts not shared by each group all
    score through the model's forward."""
    model, tok = _model()
    batch = _batch(model, tok)
    model.train()
    calls = []
    real = packed_scoring.packed_hidden
    monkeypatch.setattr(scoring, "packed_hidden", lambda *a, **k: calls.append(1) or real(*a, **k))

    def packed_calls(**patches):
        calls.clear()
        with monkeypatch.context() as mp:
            for name, value in patches.items():
                mp.setattr(scoring, name, value)
            logp, _ = completion_logprobs(model, batch, 1.0)
        assert torch.isfinite(logp[batch.completion_mask]).all()
        return len(calls)

    assert packed_calls() == 1
    assert packed_calls(PACKED=False) == 0
    assert packed_calls(HEAD_CHUNK=0) == 0
    assert packed_calls(groups_share_prompts=lambda b: False) == 0
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    assert not packed_scoring.packed_supported(model) and packed_calls() == 0
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    enable_activation_checkpointing(model)
    assert packed_calls() == 1
    assert packed_calls(_fsdp_sharded=lambda m: True) == 0  # a replay would not gather FSDP2's weights
    with torch.no_grad():  # nothing replays without a backward
        assert packed_calls(_fsdp_sharded=lambda m: True) == 1


def test_checkpointed_packed_scoring_replays_each_layer_and_gives_the_same_gradients(monkeypatch):
    """Activation checkpointing on: packed scoring keeps each layer's input only and runs the
    layer again in backward (every layer twice), with the same log-probs, entropy and gradients
    as without it, in float64."""
    model, tok = _model()
    batch = _batch(model, tok)
    model = model.double().train()
    layers, runs = len(model.model.layers), []
    real = packed_scoring._layer
    monkeypatch.setattr(packed_scoring, "_layer", lambda *a: runs.append(1) or real(*a))
    plain = _scored(model, batch, True, monkeypatch)
    assert len(runs) == layers
    runs.clear()
    enable_activation_checkpointing(model)
    assert scoring._replays_layers(model)
    replayed = _scored(model, batch, True, monkeypatch)
    assert len(runs) == 2 * layers  # forward, then each layer again in backward
    _assert_same(replayed, plain, batch.completion_mask, atol=1e-12)


def test_packed_supported_refuses_what_it_does_not_restate():
    """Each excluded configuration falls back: eager attention, a sliding window, a non-full
    layer type, attention dropout while training, and a layer class whose forward is not
    transformers' own (remote code under a mirrored model type)."""
    model, _ = _model("qwen2")
    model.train()
    assert packed_scoring.packed_supported(model)
    cfg = model.config
    for name, value in (("_attn_implementation", "eager"), ("use_sliding_window", True),
                        ("layer_types", ["full_attention", "sliding_attention"]), ("attention_dropout", 0.1)):
        old = getattr(cfg, name)
        setattr(cfg, name, value)
        assert not packed_scoring.packed_supported(model), name
        setattr(cfg, name, old)
    assert packed_scoring.packed_supported(model)
    layer = model.model.layers[1]
    layer.__class__ = type("RemoteLayer", (type(layer),), {"forward": lambda self, *a, **k: None})
    assert not packed_scoring.packed_supported(model)


@pytest.mark.parametrize("case", ["narrow_prompts", "one_token_rows", "group_of_one", "empty_row"])
def test_packed_scoring_edge_batches(monkeypatch, case):
    """Batches the trainer can hand over: a micro-batch of short prompts inside a wider left-padded
    prompt tensor, every row EOS at its first token with room for more, groups of one, and a row
    with no scored token (``completion_mask`` all False). Packed equals the padded pieces."""
    model, tok = _model()
    G = 1 if case == "group_of_one" else 2
    batch = _batch(model, tok, G=G, early=())
    if case == "narrow_prompts":  # the shortest prompt's group alone, still padded to the longest
        rows = [i for i in range(len(batch)) if batch.prompt_mask[i].sum() == batch.prompt_mask.sum(-1).min()]
        batch = RolloutBatch(batch.prompt_ids[rows], batch.prompt_mask[rows], batch.completion_ids[rows],
                             batch.completion_mask[rows], batch.truncated[rows], G, [], [])
        assert (batch.prompt_mask == 0).any(dim=1).all()
    if case == "one_token_rows":
        batch.completion_mask[:, 1:] = False
        assert batch.completion_ids.shape[1] > 1
    if case == "empty_row":
        batch.completion_mask[1] = False
    model = model.double().train()
    m = batch.completion_mask
    packed, pieces = _scored(model, batch, True, monkeypatch), _scored(model, batch, False, monkeypatch)
    _assert_same(packed, pieces, m, atol=1e-10)


def test_a_prompt_without_tokens_is_refused(monkeypatch):
    model, tok = _model()
    batch = _batch(model, tok, G=2, early=())
    batch.prompt_mask[:2] = 0
    monkeypatch.setattr(scoring, "PACKED", True)
    with pytest.raises(ValueError, match="prompt has no tokens"):
        completion_logprobs(model, batch, 1.0)
