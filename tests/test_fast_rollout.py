"""The shared-prefix decoder and scorer do exactly what generate and the full forward do."""
import pytest
import torch

from grpo_core.model.loading import build_tiny
from grpo_core.policy.scoring import completion_logprobs, groups_share_prompts, length_chunks
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import fast_decode_supported, sample_inverse_cdf, sample_shared_prefix
from grpo_core.rollout.generate import _generate, completion_mask, encode_prompts, generate_rollouts

PROMPTS = ["What is 3 + 4?", "A much longer question so the batch is left padded: 12 * 11?", "7 * 8?"]


def _model(arch="llama", kv_heads=None, rope=None):
    torch.manual_seed(0)
    model, tok = build_tiny(arch, hidden=32, layers=2, heads=4)
    if kv_heads or rope:
        from transformers import AutoModelForCausalLM
        if kv_heads:  # grouped-query attention, as in Qwen2 checkpoints
            model.config.num_key_value_heads = kv_heads
        if rope:  # scaled rotary embedding (long-context checkpoints): cos/sin from the model each step
            model.config.rope_parameters = {**model.config.rope_parameters, **rope}
        model = AutoModelForCausalLM.from_config(model.config)
    with torch.no_grad():  # large random weights: logits far from uniform, positions matter
        for p in model.parameters():
            p.normal_(0, 0.3)
    return model.eval(), tok


def _prompts(tok, prompts=PROMPTS):
    ids, mask = encode_prompts(tok, prompts, 256)
    assert (mask == 0).any(), "left padding is what makes positions matter"
    return ids, mask


LINEAR_ROPE = {"rope_type": "linear", "factor": 2.0}  # a scaled variant whose phases move every position


@pytest.mark.parametrize("arch,kv,rope", [("llama", None, None), ("qwen2", None, None), ("qwen2", 2, None),
                                          ("llama", 2, LINEAR_ROPE)],
                         ids=["llama", "qwen2", "qwen2-gqa", "linear-rope-gqa"])
def test_greedy_tokens_equal_generate(arch, kv, rope):
    model, tok = _model(arch, kv, rope)
    assert fast_decode_supported(model)
    assert model.model.rotary_emb.rope_type == (rope or {}).get("rope_type", "default")
    ids, mask = _prompts(tok)
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    ref = _generate(model, ids, mask, 2, 16, tok.eos_token_id, tok.pad_token_id, **kw)
    fast = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=16, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id, greedy=True)
    assert ref.shape == fast.shape == (6, 16)
    assert torch.equal(fast, ref)


def test_greedy_stops_and_pads_like_generate():
    """Use a token greedy decoding emits early as 'EOS': rows stop and pad exactly as generate's."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    free = sample_shared_prefix(model, ids, mask, 1, max_new_tokens=12, eos_id=-1, pad_id=0, greedy=True)
    eos = int(free[1, 3])  # row 1 stops at step 3; the others stop wherever they emit it, or not
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    ref = _generate(model, ids, mask, 2, 12, eos, tok.pad_token_id, **kw)
    fast = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=12, eos_id=eos, pad_id=tok.pad_token_id,
                                greedy=True)
    assert torch.equal(fast, ref)
    assert (fast == tok.pad_token_id).any()
    one = sample_shared_prefix(model, ids[1:2], mask[1:2], 3, max_new_tokens=12, eos_id=eos,
                               pad_id=tok.pad_token_id, greedy=True)
    assert one.shape == (3, 4), "decoding stops as soon as every row has emitted EOS"


def test_generate_rollouts_fast_and_generate_engines_agree_under_greedy():
    model, tok = _model()
    rows = [{"id": str(i), "prompt": p, "gold": "1"} for i, p in enumerate(PROMPTS)]
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, max_prompt_tokens=256, greedy=True)
    a = generate_rollouts(model, tok, rows, 2, engine="decoder", **kw)
    b = generate_rollouts(model, tok, rows, 2, engine="generate", **kw)
    for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert a.completions == b.completions and a.columns == b.columns


def test_top_k_one_samples_the_argmax():
    model, tok = _model()
    ids, mask = _prompts(tok)
    common = dict(max_new_tokens=8, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id)
    greedy = sample_shared_prefix(model, ids, mask, 2, greedy=True, **common)
    top1 = sample_shared_prefix(model, ids, mask, 2, temperature=0.7, top_k=1, **common)
    assert torch.equal(greedy, top1)


def test_inverse_cdf_sampler_draws_each_token_with_its_probability():
    """Frequencies within 4.5 standard errors of the probabilities; zero-probability tokens (as
    top-k / top-p leave them) never drawn; rows need not sum to 1."""
    n = 200_000
    p = torch.tensor([0.1, 0.0, 0.6, 0.3, 0.0])
    torch.manual_seed(0)
    counts = torch.bincount(sample_inverse_cdf(p.expand(n, 5)), minlength=5).double()
    se = (p.double() * (1 - p.double()) / n).sqrt()
    assert ((counts / n - p.double()).abs() <= 4.5 * se).all(), counts / n
    assert counts[1] == counts[4] == 0
    rows = torch.tensor([[0.0, 0.0, 2.0], [5.0, 0.0, 0.0], [0.0, 3.0, 1.0]])
    assert sample_inverse_cdf(rows)[:2].tolist() == [2, 0]
    draws = sample_inverse_cdf(rows[2:].expand(n, 3))
    assert (draws != 0).all() and abs((draws == 1).double().mean().item() - 0.75) < 4.5 * (0.75 * 0.25 / n) ** 0.5
    with pytest.raises(ValueError, match="sampler"):
        sample_shared_prefix(_model()[0], torch.ones(1, 2, dtype=torch.long), torch.ones(1, 2, dtype=torch.long), 2,
                             max_new_tokens=2, eos_id=0, pad_id=0, sampler="gumbel")


@pytest.mark.parametrize("temperature,model_args", [(1.0, ()), (0.7, ()), (1.0, ("llama", 2, LINEAR_ROPE))],
                         ids=["T1", "T0.7", "T1-linear-rope-gqa"])
def test_scored_logprobs_equal_the_decoder_sampling_distribution(temperature, model_args):
    """The loss scores exactly the distribution the fast decoder sampled from (left padding, T != 1,
    grouped-query attention, a scaled rotary embedding): every step's logits, at every position."""
    model, tok = _model(*model_args)
    ids, mask = _prompts(tok)
    G, steps = 3, []
    torch.manual_seed(1)
    comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=12, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id, temperature=temperature, step_logits=steps).clone()
    cmask, trunc = completion_mask(comp, tok.eos_token_id)
    batch = RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask, trunc, G, [], [])
    assert groups_share_prompts(batch)
    sampled = torch.log_softmax(torch.stack(steps, 1) / temperature, -1).gather(-1, comp[..., None])[..., 0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, temperature)
    assert torch.allclose(logp[cmask], sampled[cmask], atol=1e-4)


@pytest.mark.parametrize("call_cost", [0, float("inf")])
def test_shared_prefix_scoring_equals_full_forward_in_value_and_gradient(monkeypatch, call_cost):
    """Shared-prefix scoring, in one padded call (inf) or in length chunks that skip the positions
    after EOS (0: one chunk per distinct length), equals the full forward at every scored position."""
    import grpo_core.policy.scoring as scoring

    model, tok = _model()
    model.train()
    ids, mask = _prompts(tok)
    G = 2
    comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=9, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id).clone()
    cmask, trunc = completion_mask(comp, tok.eos_token_id)
    for row, length in ((0, 5), (3, 1), (4, 7)):  # early-EOS rows; their masked positions must not matter
        cmask[row, length:] = False
    batch = RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask, trunc, G, [], [])
    monkeypatch.setattr(scoring, "SCORE_CALL_COST", call_cost)
    monkeypatch.setattr(scoring, "PACKED", False)  # the padded pieces (packed: test_packed_scoring.py)
    chunks = []
    monkeypatch.setattr(scoring, "length_chunks", lambda *a, **k: chunks.append(length_chunks(*a, **k)) or chunks[-1])
    results = []
    for share in (True, False):
        monkeypatch.setattr(scoring, "groups_share_prompts", lambda b, share=share: share)
        model.zero_grad()
        logp, ent = completion_logprobs(model, batch, 0.8, with_entropy=True)
        (logp * cmask).sum().backward()
        results.append((logp.detach(), ent, [p.grad.clone() for p in model.parameters()]))
    assert len(chunks[0]) == (len(set(cmask.sum(-1).tolist())) if call_cost == 0 else 1)
    (a, ea, ga), (b, eb, gb) = results
    assert torch.allclose(a[cmask], b[cmask], atol=1e-4)
    assert torch.allclose(ea[cmask], eb[cmask], atol=1e-4)
    for x, y in zip(ga, gb):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-3)


def _partition_cost(lengths, chunks, call_cost):
    return sum(len(c) * max(lengths[i] for i in c) + call_cost for c in chunks)


@pytest.mark.parametrize("seed", range(6))
def test_length_chunks_is_the_cheapest_partition(seed):
    """Every row once, and no split of the length-sorted rows (brute force over all cut sets, cuts
    inside runs of equal length included) is cheaper than the chosen chunks."""
    import itertools
    import random

    rng = random.Random(seed)
    lengths = [rng.choice([1, 2, 3, 5, 8, 9, 9, 12]) for _ in range(10)]
    call_cost = rng.choice([0, 3, 10, 40])
    chunks = length_chunks(lengths, call_cost)
    assert sorted(i for c in chunks for i in c) == list(range(10))
    order = sorted(range(10), key=lambda i: -lengths[i])
    brute = min(_partition_cost(lengths, [order[a:b] for a, b in zip((0,) + cuts, cuts + (10,))], call_cost)
                for k in range(10) for cuts in itertools.combinations(range(1, 10), k))
    assert _partition_cost(lengths, chunks, call_cost) == brute


def test_length_chunks_by_hand():
    lengths = [5, 1, 2, 6, 7, 7, 5, 7]
    assert length_chunks(lengths, 0) == [[4, 5, 7], [3], [0, 6], [2], [1]]  # a chunk per distinct length
    assert length_chunks(lengths, 1000) == [[4, 5, 7, 3, 0, 6, 2, 1]]       # one call: 8 x 7 positions
    # cost 6: {7,7,7,6,5,5} x 7 + {2,1} x 2 = 42 + 4 + 2 x 6 = 58 beats one call (56 + 6 = 62)
    assert length_chunks(lengths, 6) == [[4, 5, 7, 3, 0, 6], [2, 1]]


def test_groups_share_prompts_detects_mixed_groups():
    _, tok = _model()
    ids, mask = _prompts(tok)
    comp = torch.zeros(6, 2, dtype=torch.long)
    ok = RolloutBatch(ids.repeat_interleave(2, 0), mask.repeat_interleave(2, 0), comp, comp.bool(), comp[:, 0].bool(),
                      2, [], [])
    mixed = RolloutBatch(ids.repeat(2, 1), mask.repeat(2, 1), comp, comp.bool(),
                         comp[:, 0].bool(), 2, [], [])
    assert groups_share_prompts(ok) and not groups_share_prompts(mixed)


def test_unsupported_models_fall_back_to_generate():
    from transformers import GPT2Config, GPT2LMHeadModel

    _, tok = _model()
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=128,
                                       pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    assert not fast_decode_supported(model)
    rows = [{"prompt": p} for p in PROMPTS[:2]]
    batch = generate_rollouts(model, tok, rows, 2, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=5,
                              max_prompt_tokens=256)
    assert batch.completion_ids.shape[0] == 4


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_same_seed_samples_the_same_tokens_as_generate(temperature):
    """Stronger than needed (it relies on bitwise-equal logits, true on CPU): same seed, same samples."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    kw = dict(temperature=temperature, top_p=1.0, top_k=0)
    torch.manual_seed(5)
    ref = _generate(model, ids, mask, 4, 16, tok.eos_token_id, tok.pad_token_id, greedy=False, **kw)
    torch.manual_seed(5)
    fast = sample_shared_prefix(model, ids, mask, 4, max_new_tokens=16, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id, compact_below=0.0, sampler="multinomial", **kw)
    assert torch.equal(fast, ref)


def test_generate_rollouts_passes_the_sampler_to_the_decoder():
    """generate_rollouts(sampler=...) (the stage config's ``sampler``) reaches the decoder: the same
    seed gives the decoder's own draws for each sampler, and the two samplers draw differently."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    rows = [{"prompt": p, "id": str(i)} for i, p in enumerate(PROMPTS)]
    kw = dict(temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=10, max_prompt_tokens=256, engine="decoder")
    out = {}
    for sampler in ("inverse_cdf", "multinomial"):
        torch.manual_seed(3)
        batch = generate_rollouts(model, tok, rows, 4, sampler=sampler, **kw)
        torch.manual_seed(3)
        direct = sample_shared_prefix(model, ids, mask, 4, max_new_tokens=10, eos_id=tok.eos_token_id,
                                      pad_id=tok.pad_token_id, sampler=sampler)
        cmask, _ = completion_mask(direct.clone(), tok.eos_token_id)
        assert torch.equal(batch.completion_ids, direct.masked_fill(~cmask, tok.pad_token_id)), sampler
        out[sampler] = batch.completion_ids
    assert not torch.equal(out["inverse_cdf"], out["multinomial"])


def _frequent_token(model, tok, ids, mask, G):
    """A token the model samples often, to stand in for EOS so that many rows stop early."""
    torch.manual_seed(0)
    free = sample_shared_prefix(model, ids, mask, G, max_new_tokens=12, eos_id=-1, pad_id=tok.pad_token_id)
    return int(torch.mode(free.flatten()).values)


def test_compaction_keeps_greedy_tokens_equal_to_generate():
    """Rows that finished leave the decode batch; the tokens of every row stay generate's."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    free = sample_shared_prefix(model, ids, mask, 1, max_new_tokens=12, eos_id=-1, pad_id=0, greedy=True)
    for eos in {int(free[0, 2]), int(free[1, 3]), int(free[2, 1])}:  # rows stop at different steps
        kw = dict(temperature=1.0, top_p=1.0, top_k=0, greedy=True)
        ref = _generate(model, ids, mask, 3, 12, eos, tok.pad_token_id, **kw)
        fast = sample_shared_prefix(model, ids, mask, 3, max_new_tokens=12, eos_id=eos, pad_id=tok.pad_token_id,
                                    greedy=True, compact_below=0.99)
        assert torch.equal(fast, ref), eos


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_compacted_decoding_samples_the_distribution_the_loss_scores(temperature):
    """With compaction active (many early stops), every kept token's sampling distribution is the
    one completion_logprobs scores: compaction moves rows, never changes what they see."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    G = 4
    eos = _frequent_token(model, tok, ids, mask, G)
    for seed in range(20):  # a draw where >= 3 rows stop early, at different steps: compaction happens
        steps = []
        torch.manual_seed(seed)
        comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=12, eos_id=eos, pad_id=tok.pad_token_id,
                                    temperature=temperature, step_logits=steps, compact_below=0.9).clone()
        cmask, trunc = completion_mask(comp, eos)
        lengths = cmask.sum(-1)
        if len(set(lengths[lengths < comp.shape[1]].tolist())) >= 2 and (lengths < comp.shape[1]).sum() >= 3:
            break
    else:
        pytest.fail("no seed in 0..19 made >= 3 rows stop early at different steps")
    batch = RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask, trunc, G, [], [])
    sampled = torch.log_softmax(torch.stack(steps, 1) / temperature, -1).gather(-1, comp[..., None])[..., 0]
    with torch.no_grad():
        logp, _ = completion_logprobs(model, batch, temperature)
    assert torch.allclose(logp[cmask], sampled[cmask], atol=1e-4)


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_ignores_the_checkpoints_generation_config(greedy):
    """A checkpoint's generation_config.json may carry logit processors (Qwen2.5-Instruct ships
    repetition_penalty=1.05). The generate fallback must sample softmax(logits / T) with only the
    stage's filters, as the decoder and the loss do: same tokens as the decoder, greedy and
    same-seed sampling; the model's own generation_config is left as it was."""
    model, tok = _model()
    ids, mask = _prompts(tok)
    kw = dict(temperature=0.7, top_p=1.0, top_k=0)
    torch.manual_seed(5)
    plain = sample_shared_prefix(model, ids, mask, 2, max_new_tokens=12, eos_id=tok.eos_token_id,
                                 pad_id=tok.pad_token_id, compact_below=0.0, sampler="multinomial",
                                 greedy=greedy, **kw)
    extras = dict(repetition_penalty=3.0, no_repeat_ngram_size=1, min_new_tokens=12, top_k=2,
                  suppress_tokens=[int(plain[0, 0])], temperature=0.2, do_sample=not greedy)
    for k, v in extras.items():
        setattr(model.generation_config, k, v)
    torch.manual_seed(5)
    out = _generate(model, ids, mask, 2, 12, tok.eos_token_id, tok.pad_token_id, greedy=greedy, **kw)
    assert torch.equal(out, plain)
    assert {k: getattr(model.generation_config, k) for k in extras} == extras


@pytest.mark.parametrize("arch,kv", [("llama", None), ("qwen2", 2)], ids=["llama", "qwen2-gqa"])
def test_shared_prefix_attention_gives_generates_tokens_with_and_without_compaction(monkeypatch, arch, kv):
    """Rows attending their prompt's K/V held once per prompt (SHARED_PREFIX_ATTENTION) decode
    exactly what generate does, also after finished rows leave the batch; and with the lever off
    (each row holds a copy), the same tokens under seeded multinomial sampling."""
    from grpo_core.rollout import decode
    model, tok = _model(arch, kv)
    ids, mask = _prompts(tok)
    free = sample_shared_prefix(model, ids, mask, 1, max_new_tokens=12, eos_id=-1, pad_id=0, greedy=True)
    eos = int(free[1, 3])
    ref = _generate(model, ids, mask, 3, 12, eos, tok.pad_token_id, temperature=1.0, top_p=1.0, top_k=0, greedy=True)
    calls, real = [], decode._Stepper._shared_prefix_attention
    monkeypatch.setattr(decode._Stepper, "_shared_prefix_attention", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(decode, "SHARED_PREFIX_ATTENTION", True)  # off by default: switch it on here
    for compact in (0.0, 0.99):
        fast = sample_shared_prefix(model, ids, mask, 3, max_new_tokens=12, eos_id=eos, pad_id=tok.pad_token_id,
                                    greedy=True, compact_below=compact)
        assert torch.equal(fast, ref), compact
    assert calls, "the shared-prefix path ran"
    sampled = {}
    for shared in (True, False):
        monkeypatch.setattr(decode, "SHARED_PREFIX_ATTENTION", shared)
        torch.manual_seed(3)
        sampled[shared] = sample_shared_prefix(model, ids, mask, 4, max_new_tokens=12, eos_id=eos,
                                               pad_id=tok.pad_token_id, sampler="multinomial", compact_below=0.9)
    assert torch.equal(sampled[True], sampled[False])
