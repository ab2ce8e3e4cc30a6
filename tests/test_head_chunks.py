"""The LM head in position chunks (``algorithm.head_logprobs``, ``scoring.HEAD_CHUNK``): the same
log-probs, entropy and gradients as the model's own logits, without ever holding [B, T, V] logits."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import grpo_core.policy.scoring as scoring
from grpo_core.algo.core import head_logprobs
from grpo_core.model.loading import build_tiny
from grpo_core.policy.scoring import chunked_head, completion_logprobs
from grpo_core.rollout.batch import RolloutBatch
from grpo_core.rollout.decode import sample_shared_prefix
from grpo_core.rollout.generate import completion_mask, encode_prompts


def _reference(hidden, weight, bias, targets, temperature):
    """Independent float64 log-softmax of the whole logits."""
    z = (hidden.double() @ weight.double().T + (0 if bias is None else bias.double())) / temperature
    logp = torch.log_softmax(z, -1)
    return logp.gather(-1, targets[..., None])[..., 0], -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("chunk", [1, 4, 1000])
@pytest.mark.parametrize("with_bias", [False, True])
def test_head_logprobs_equal_float64_reference_in_value_and_gradient(chunk, with_bias):
    torch.manual_seed(0)
    hidden = torch.randn(3, 5, 8, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(11, 8, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(11, dtype=torch.float64, requires_grad=True) if with_bias else None
    targets, upstream = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, dtype=torch.float64)
    inputs = [hidden, weight] + ([bias] if with_bias else [])
    logp, ent = head_logprobs(hidden, weight, targets, 0.7, bias=bias, chunk_size=chunk, with_entropy=True)
    grads = torch.autograd.grad((logp * upstream).sum(), inputs)
    ref_logp, ref_ent = _reference(hidden, weight, bias, targets, 0.7)
    ref_grads = torch.autograd.grad((ref_logp * upstream).sum(), inputs)
    assert logp.shape == ent.shape == (3, 5) and not ent.requires_grad
    assert torch.allclose(logp, ref_logp, atol=1e-12) and torch.allclose(ent, ref_ent, atol=1e-12)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, atol=1e-12)


def test_head_logprobs_in_bfloat16_matmuls_stay_close_and_keep_dtypes():
    """compute_dtype=bfloat16 (what an autocast forward asks): bf16 matmuls, float32 softmax, and
    float32 gradients for float32 weights, all close to the float64 reference at temperature 0.7."""
    torch.manual_seed(1)
    hidden = torch.randn(4, 6, 16, requires_grad=True)
    weight = (torch.randn(50, 16) * 0.3).requires_grad_()
    targets, upstream = torch.randint(0, 50, (4, 6)), torch.randn(4, 6)
    logp, _ = head_logprobs(hidden, weight, targets, 0.7, chunk_size=5, compute_dtype=torch.bfloat16)
    (logp * upstream).sum().backward()
    ref, _ = _reference(hidden, weight, None, targets, 0.7)
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), [hidden, weight])
    assert logp.dtype == hidden.grad.dtype == weight.grad.dtype == torch.float32
    assert (logp.double() - ref).abs().max() < 0.1
    assert not torch.allclose(logp.double(), ref, atol=1e-5)  # the matmuls did run in bf16
    for got, want in zip((hidden.grad, weight.grad), ref_grads):
        assert (got.double() - want).norm() < 0.05 * want.norm()


@pytest.mark.parametrize("kwargs,match", [
    (dict(targets=torch.zeros(3, 4, dtype=torch.long)), "targets must be"),
    (dict(weight=torch.randn(11, 7)), r"weight must be \[V, 8\]"),
    (dict(temperature=0.0), "temperature must be > 0"),
    (dict(chunk_size=0), "chunk_size must be >= 1"),
])
def test_head_logprobs_refuses_bad_input(kwargs, match):
    args = dict(hidden=torch.randn(3, 5, 8), weight=torch.randn(11, 8), targets=torch.zeros(3, 5, dtype=torch.long))
    with pytest.raises(ValueError, match=match):
        head_logprobs(**{**args, **kwargs})


def _rollout(arch="llama", G=2):
    torch.manual_seed(0)
    model, tok = build_tiny(arch, hidden=32, layers=2, heads=4)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    ids, mask = encode_prompts(tok, ["What is 3 + 4?", "A longer one, left padded: 12 * 11?"], 256)
    comp = sample_shared_prefix(model, ids, mask, G, max_new_tokens=9, eos_id=tok.eos_token_id,
                                pad_id=tok.pad_token_id).clone()
    cmask, trunc = completion_mask(comp, tok.eos_token_id)
    cmask[0, 4:] = cmask[3, 1:] = False  # early-EOS rows: length chunks of different lengths
    return model.train(), RolloutBatch(ids.repeat_interleave(G, 0), mask.repeat_interleave(G, 0), comp, cmask,
                                       trunc, G, [], [])


def _scored(model, batch, shared_prefix=True):
    model.zero_grad()
    logp, ent = completion_logprobs(model, batch, 0.8, with_entropy=True, shared_prefix=shared_prefix)
    (logp * batch.completion_mask).sum().backward()
    return logp.detach(), ent, [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("shared_prefix", [True, False])
def test_chunked_head_scores_what_the_models_own_logits_score(monkeypatch, arch, shared_prefix):
    """Shared-prefix scoring (one piece per completion length) and the full forward, with the head
    in chunks of 3 positions, give the log-probs, entropy and parameter gradients (tied
    embeddings: head and input both) of the model's own logits (HEAD_CHUNK = 0)."""
    model, batch = _rollout(arch)
    monkeypatch.setattr(scoring, "SCORE_CALL_COST", 0)  # a piece per distinct length
    monkeypatch.setattr(scoring, "PACKED", False)  # the padded pieces (packed: test_packed_scoring.py)
    calls = []
    real = scoring.head_logprobs
    monkeypatch.setattr(scoring, "head_logprobs", lambda *a, **k: calls.append(k["keep_last"]) or real(*a, **k))
    monkeypatch.setattr(scoring, "HEAD_CHUNK", 3)
    chunked = _scored(model, batch, shared_prefix)
    lengths = set(batch.completion_mask.sum(-1).tolist())
    assert calls == ([False] * (len(lengths) - 1) + [True] if shared_prefix else [True]) and len(lengths) > 2
    monkeypatch.setattr(scoring, "HEAD_CHUNK", 0)
    assert chunked_head(model) is None
    whole = _scored(model, batch, shared_prefix)
    assert len(calls) == (len(lengths) if shared_prefix else 1)  # the model's own head: no more calls
    m = batch.completion_mask
    assert torch.allclose(chunked[0][m], whole[0][m], atol=1e-5)
    assert torch.allclose(chunked[1][m], whole[1][m], atol=1e-5)
    for got, want in zip(chunked[2], whole[2]):
        assert torch.allclose(got, want, atol=1e-6, rtol=1e-4)


def test_chunked_head_under_bf16_autocast_scores_what_the_models_own_head_scores(monkeypatch):
    """precision = "bf16" runs scoring under CPU autocast: the chunked head's matmuls run in bf16
    as the model's own head's do, so both give nearly the same log-probs and gradients."""
    model, batch = _rollout()
    results = []
    for chunk in (3, 0):
        monkeypatch.setattr(scoring, "HEAD_CHUNK", chunk)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            model.zero_grad()
            logp, _ = completion_logprobs(model, batch, 0.8)
        (logp * batch.completion_mask).sum().backward()
        results.append((logp.detach(), [p.grad.clone() for p in model.parameters()]))
    (a, ga), (b, gb) = results
    m = batch.completion_mask
    assert a.dtype == torch.float32 and (a[m] - b[m]).abs().max() < 0.05
    for got, want in zip(ga, gb):
        assert (got - want).norm() <= 0.05 * want.norm() + 1e-6


class _LargestVocabTensor(TorchDispatchMode):
    """Records the most elements of any float tensor an op returns whose last dimension is V, the
    head weight's own transpose [H, V] aside."""

    def __init__(self, vocab, hidden):
        super().__init__()
        self.vocab, self.hidden, self.largest = vocab, hidden, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() and t.shape[-1] == self.vocab \
                    and tuple(t.shape) != (self.hidden, self.vocab):
                self.largest = max(self.largest, t.numel())
        return out


@pytest.mark.parametrize("head_chunk", [4, 0])
def test_update_never_holds_more_than_a_chunk_of_logits(monkeypatch, head_chunk):
    """Forward and backward of the update's scoring: with chunks of 4 positions no tensor of
    vocabulary width exceeds [4, V]; the model's own head (0) builds the whole [B, T, V]."""
    model, batch = _rollout()
    V, H = model.config.vocab_size, model.config.hidden_size
    assert V not in (H, 4 * H)  # only logits have V columns
    monkeypatch.setattr(scoring, "HEAD_CHUNK", head_chunk)
    with _LargestVocabTensor(V, H) as seen:
        _scored(model, batch, shared_prefix=False)
    if head_chunk:
        assert seen.largest == 4 * V
    else:
        assert seen.largest >= batch.completion_ids.numel() * V


@pytest.mark.parametrize("shared_prefix,packed", [(True, True), (True, False), (False, False)])
def test_what_waits_for_backward_is_one_chunk_of_softmax_in_all(monkeypatch, shared_prefix, packed):
    """Of vocabulary width, autograd keeps at most one [<= 4, V] softmax for backward per scoring
    call: packed, or however many pieces (completion lengths) the padded shared-prefix scorer
    makes, or the full forward; the model's own head keeps every scored position's logits."""
    model, batch = _rollout()
    monkeypatch.setattr(scoring, "SCORE_CALL_COST", 0)  # a piece per distinct length
    monkeypatch.setattr(scoring, "PACKED", packed)
    V, H = model.config.vocab_size, model.config.hidden_size
    kept = {}
    for chunk in (4, 0):
        monkeypatch.setattr(scoring, "HEAD_CHUNK", chunk)
        storages = {}

        def pack(t):
            if t.is_floating_point() and t.dim() and t.shape[-1] == V and tuple(t.shape) != (H, V):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            logp, _ = completion_logprobs(model, batch, 1.0, shared_prefix=shared_prefix)
        kept[chunk] = sum(storages.values())
    scored = int(batch.completion_mask.sum())
    assert 0 < kept[4] <= 4 * V * 4 and kept[0] >= scored * V * 4, kept


def test_models_whose_logits_are_not_the_heads_output_keep_their_own_head(monkeypatch):
    """A compiled scorer, a model type outside HEAD_MODEL_TYPES and an adapted head fall back to
    the model's logits, and scoring still works."""
    model, batch = _rollout()
    compiled = torch.nn.Module()  # what torch.compile returns keeps the model as _orig_mod (not
    compiled._orig_mod = model    # compiled here: dynamo fails to import once metaflow is loaded)
    assert chunked_head(compiled) is None
    monkeypatch.setattr(model.config, "model_type", "gemma2")  # soft-capped logits
    assert chunked_head(model) is None
    logp, _ = completion_logprobs(model, batch, 1.0)
    assert torch.isfinite(logp[batch.completion_mask]).all()
    monkeypatch.setattr(model.config, "model_type", "llama")
    monkeypatch.setattr(model, "lm_head", torch.nn.Sequential(model.lm_head))
    assert chunked_head(model) is None
