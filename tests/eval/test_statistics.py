"""Bootstrap intervals and paired differences: seeded, and honest about what they cannot tell."""
from __future__ import annotations

from kvtier.eval import metrics


def test_bootstrap_is_seeded_and_brackets_the_mean():
    xs = [0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0, 0.0]
    a, b = metrics.bootstrap_ci(xs, seed=3), metrics.bootstrap_ci(xs, seed=3)
    assert a == b
    lo, hi = a
    assert 0.0 <= lo < sum(xs) / len(xs) < hi <= 1.0
    assert metrics.bootstrap_ci([0.5], seed=0) == (0.5, 0.5)


def test_paired_difference_marks_what_is_inside_its_interval():
    ref = [1.0, 0.0, 1.0, 1.0, 0.0, 1.0]
    same_ish = [1.0, 1.0, 1.0, 0.0, 0.0, 1.0]   # one up, one down: no difference to speak of
    worse = [0.0] * 6
    d = metrics.paired_diff(ref, same_ish, seed=0)
    assert d["mean"] == 0.0 and d["within_ci"]
    d = metrics.paired_diff(ref, worse, seed=0)
    assert d["hi"] < 0 and not d["within_ci"]
