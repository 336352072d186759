import pytest
import torch

from lmkernels.engine import Engine, SamplingParams, filter_logits, sample
from lmkernels.models import prefill_logits

from .conftest import random_prompts


def test_top_k_and_top_p_keep_exactly_their_support():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 100, generator=g) * 3
    one = torch.ones(4)
    k = torch.tensor([1, 5, 0, 100])
    out = filter_logits(logits, one, k, one)
    for row, kk in zip(range(4), [1, 5, 100, 100]):
        kept = torch.isfinite(out[row]).nonzero().flatten()
        assert set(kept.tolist()) == set(logits[row].topk(kk).indices.tolist())
    assert torch.allclose(out.exp().sum(-1), torch.ones(4))
    p = torch.tensor([0.1, 0.5, 0.9, 1.0])
    out = filter_logits(logits, one, torch.zeros(4, dtype=torch.long), p)
    for row in range(4):
        probs = logits[row].softmax(-1)
        order = probs.argsort(descending=True)
        mass = probs[order].cumsum(0)
        n = int((mass < p[row] - 1e-6).sum()) + 1 if p[row] < 1 else 100  # the smallest prefix with mass ≥ p
        assert set(torch.isfinite(out[row]).nonzero().flatten().tolist()) == set(order[:n].tolist())
    # temperature sharpens: renormalised probabilities of logits / T
    t = torch.full((4,), 0.5)
    assert torch.allclose(filter_logits(logits, t, torch.zeros(4, dtype=torch.long), one),
                          (logits / 0.5).log_softmax(-1), atol=1e-5)


def test_sampled_frequencies_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -1.0]])
    params = SamplingParams(temperature=1.0, top_k=4, top_p=0.9)
    g = torch.Generator().manual_seed(3)
    draws = torch.tensor([sample(logits, [params], [g])[0] for _ in range(4000)])
    counts = torch.bincount(draws, minlength=6).float() / len(draws)
    target = filter_logits(logits, torch.ones(1), torch.tensor([4]), torch.tensor([0.9])).exp()[0]
    assert counts[target == 0].sum() == 0  # nothing outside the support
    assert (counts - target).abs().max() < 0.03


def test_seeded_sampling_is_reproducible_and_batch_independent(tiny_model):
    prompts = random_prompts((9, 30, 4))
    e = Engine(tiny_model, num_pages=64, page_size=4, eos_token_ids=[])
    p = SamplingParams(max_new_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=7)
    solo = e.generate([prompts[0]], p)[0].token_ids
    assert e.generate([prompts[0]], p)[0].token_ids == solo
    others = [SamplingParams(max_new_tokens=6, temperature=1.0, seed=1), SamplingParams(max_new_tokens=14)]
    batch = e.generate(prompts[::-1], [others[1], others[0], p])  # prompt 0 last, among other requests
    assert batch[2].token_ids == solo
    # under preemption (recomputed from prompt + generated tokens) the draws do not change either
    tight = Engine(tiny_model, num_pages=10, page_size=4, eos_token_ids=[], max_num_batched_tokens=8)
    out = tight.generate([prompts[1], prompts[0]], [others[0], p])
    assert tight.stats.preemptions > 0 and out[1].token_ids == solo
    seeds = {tuple(e.generate([prompts[0]], SamplingParams(max_new_tokens=10, temperature=0.9, seed=s))[0]
                   .token_ids) for s in range(4)}
    assert len(seeds) > 1  # the seed matters


def test_top_k_restricts_each_sampled_token(tiny_model):
    prompt = random_prompts((12,), seed=5)[0]
    e = Engine(tiny_model, num_pages=32, page_size=4, eos_token_ids=[])
    out = e.generate([prompt], SamplingParams(max_new_tokens=12, temperature=2.0, top_k=3, seed=0))[0].token_ids
    for i, tok in enumerate(out):  # each token is among the 3 most likely after the tokens before it
        logits = prefill_logits(tiny_model, [prompt + out[:i]])[0]
        assert tok in logits.topk(3).indices.tolist()
    assert out != e.generate([prompt], SamplingParams(max_new_tokens=12))[0].token_ids  # not just greedy
    one = e.generate([prompt], SamplingParams(max_new_tokens=12, temperature=5.0, top_k=1, seed=0))[0].token_ids
    assert one == e.generate([prompt], SamplingParams(max_new_tokens=12))[0].token_ids


@pytest.mark.parametrize("kw,match", [
    ({"max_new_tokens": 0}, "max_new_tokens"), ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"), ({"top_p": 0.0}, "top_p"), ({"top_p": 1.5}, "top_p"),
    ({"top_k": -3}, "top_k"), ({"top_k": 2.5}, "top_k"), ({"seed": "x"}, "seed"), ({"stop": [""]}, "stop"),
])
def test_invalid_sampling_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
