import pytest
import torch

from hybrid.errors import HybridError
from hybrid.sampler import Sampler, SamplerConfig

LOGITS = torch.tensor([1.0, 3.0, 2.9, -1.0, 0.5])


def draws(n=400, **kw):
    s = Sampler(SamplerConfig(temperature=1.0, seed=0, **kw))
    return {s(LOGITS, []) for _ in range(n)}


def test_greedy_is_argmax_and_ties_go_low():
    s = Sampler(SamplerConfig())
    assert s(LOGITS, []) == 1
    assert s(torch.tensor([2.0, 5.0, 5.0]), []) == 1


def test_top_k_top_p_min_p_restrict_support():
    assert draws(top_k=2) == {1, 2}
    assert draws(top_p=0.5) <= {1, 2} and 1 in draws(top_p=0.5)
    assert draws(min_p=0.5) == {1, 2}
    assert len(draws()) == 5


def test_penalties_change_choice():
    s = Sampler(SamplerConfig(presence_penalty=1.0))
    assert s(LOGITS, [1]) == 2
    s = Sampler(SamplerConfig(repetition_penalty=2.0))
    assert s(LOGITS, [1]) == 2


def test_seed_reproducible():
    a = Sampler(SamplerConfig(temperature=1.0, seed=7))
    b = Sampler(SamplerConfig(temperature=1.0, seed=7))
    assert [a(LOGITS, []) for _ in range(20)] == [b(LOGITS, []) for _ in range(20)]


@pytest.mark.parametrize("kw", [{"temperature": -1}, {"top_p": 0}, {"min_p": 2}, {"top_k": -1}])
def test_bad_values(kw):
    with pytest.raises(HybridError):
        SamplerConfig(**kw)
