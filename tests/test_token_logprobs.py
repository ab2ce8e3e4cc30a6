"""Chunked token log-probs and entropy (grpo_core.algo.core) against log_softmax in float64, their
gradients, bf16 upcasting and saved memory; the masked mean.
"""
import math

import pytest
import torch

from grpo_core.algo.core import masked_mean, token_entropy, token_logprobs


@pytest.mark.parametrize("chunk_size", [1, 4, 7, 1024])
def test_token_logprobs_match_log_softmax(chunk_size):
    g = torch.Generator().manual_seed(chunk_size)
    B, T, V = 3, 5, 11
    logits = (3 * torch.randn(B, T, V, generator=g, dtype=torch.float64)).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    upstream = torch.randn(B, T, generator=g, dtype=torch.float64)

    got = token_logprobs(logits, targets, temperature=0.7, chunk_size=chunk_size)
    (grad,) = torch.autograd.grad((got * upstream).sum(), logits)
    want = torch.log_softmax(logits / 0.7, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    (grad_ref,) = torch.autograd.grad((want * upstream).sum(), logits)

    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref, rtol=1e-12, atol=1e-12)


def test_token_logprobs_gradcheck():
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(2, 3, 5, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (2, 3), generator=g)
    assert torch.autograd.gradcheck(lambda x: token_logprobs(x, targets, temperature=1.3, chunk_size=2), (logits,))


def test_token_logprobs_bfloat16_upcasts_output_keeps_grad_dtype():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, 7, (2, 3))
    out = token_logprobs(logits, targets, chunk_size=4)
    out.sum().backward()
    assert out.dtype == torch.float32 and logits.grad.dtype == torch.bfloat16
    want = torch.log_softmax(logits.float(), -1).gather(-1, targets[..., None]).squeeze(-1)
    torch.testing.assert_close(out, want)


@pytest.mark.parametrize("chunk_size", [1, 4, 1024])
def test_token_entropy_matches_reference(chunk_size):
    g = torch.Generator().manual_seed(5)
    logits = 2 * torch.randn(3, 5, 11, generator=g, dtype=torch.float64)
    logp = torch.log_softmax(logits / 0.7, dim=-1)
    want = -(logp.exp() * logp).sum(-1)
    torch.testing.assert_close(token_entropy(logits, temperature=0.7, chunk_size=chunk_size), want)
    # uniform logits -> entropy log V
    torch.testing.assert_close(token_entropy(torch.zeros(1, 2, 8)), torch.full((1, 2), math.log(8)))


def test_masked_mean():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, float("nan"), 4.0]])
    mask = torch.tensor([[True, True, False], [True, False, True]])
    assert masked_mean(x, mask).item() == pytest.approx((1 + 2 + 3 + 4) / 4)
    assert masked_mean(x, torch.zeros_like(mask)).item() == 0.0


def test_token_logprobs_saves_no_float32_copy_of_logits():
    # plain autograd over upcast chunks would save float32 [B*T, V] for backward; we save bf16 logits + [B*T] lse
    logits = torch.randn(4, 8, 64).to(torch.bfloat16).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel() * t.element_size()) or t,
                                                  lambda t: t):
        token_logprobs(logits, torch.randint(0, 64, (4, 8)), chunk_size=8)
    assert sum(saved) <= logits.numel() * logits.element_size() + 4 * 8 * (4 + 8)  # logits + lse + targets
