import math

import pytest
import torch

from kvtier.eval import metrics


def _logp(seed=0, steps=12, vocab=50):
    g = torch.Generator().manual_seed(seed)
    return torch.log_softmax(torch.randn(steps, vocab, generator=g) * 3, dim=-1)


def test_reference_against_itself_is_exact():
    lp = _logp()
    targets = lp.argmax(1)
    m = metrics.compare(lp, lp, targets)
    assert m["ppl_rel_change"] == 0.0
    assert m["kl_mean"] == pytest.approx(0.0, abs=1e-12)
    assert m["top1_agreement"] == 1.0
    assert m["ppl"] == m["ppl_ref"]


def test_perplexity_of_uniform_is_vocab_size():
    lp = torch.full((5, 40), -math.log(40))
    assert metrics.perplexity(lp, torch.zeros(5, dtype=torch.long)) == pytest.approx(40.0)


def test_kl_matches_hand_computation():
    p = torch.tensor([[0.5, 0.5]]).log()
    q = torch.tensor([[0.9, 0.1]]).log()
    expected = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert metrics.kl_divergence(p, q).item() == pytest.approx(expected)


def test_agreement_and_accuracy_count_argmax():
    ref = torch.tensor([[0.0, -5.0], [0.0, -5.0], [-5.0, 0.0], [-5.0, 0.0]])
    got = torch.tensor([[0.0, -5.0], [-5.0, 0.0], [-5.0, 0.0], [0.0, -5.0]])
    assert metrics.top1_agreement(ref, got) == 0.5
    assert metrics.top1_accuracy(got, torch.tensor([0, 1, 1, 1])) == 0.75


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="ref_logp"):
        metrics.kl_divergence(torch.zeros(3), torch.zeros(3, 2))
    with pytest.raises(ValueError, match="targets"):
        metrics.nll(torch.zeros(3, 2), torch.zeros(4, dtype=torch.long))


def test_pareto_front():
    pts = [(1.0, 5.0), (2.0, 1.0), (3.0, 2.0), (0.5, 9.0), (2.0, 0.5)]
    assert metrics.pareto_front(pts) == [3, 0, 4]
