"""Accuracy metrics of a cache configuration against the exact reference, on the same tokens.

All functions take per-step next-token log-probabilities ``[steps, vocab]`` (float32, log-softmax
already applied) and the target token ids ``[steps]``; they are pure torch and know nothing of
caches or models.
"""
from __future__ import annotations

import math

import torch


def _check(logp: torch.Tensor, name: str) -> None:
    if logp.dim() != 2 or logp.shape[0] == 0:
        raise ValueError(f"{name} must be [steps, vocab] with steps >= 1, got {tuple(logp.shape)}")


def nll(logp: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood of each target token. Returns ``[steps]``."""
    _check(logp, "logp")
    if targets.shape != (logp.shape[0],):
        raise ValueError(f"targets must be [steps]={logp.shape[0]}, got {tuple(targets.shape)}")
    return -logp.gather(1, targets.view(-1, 1).long()).squeeze(1)


def perplexity(logp: torch.Tensor, targets: torch.Tensor) -> float:
    return math.exp(nll(logp, targets).double().mean().item())


def kl_divergence(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(ref || cfg) per step, in nats. Returns ``[steps]`` (>= 0 up to rounding)."""
    _check(ref_logp, "ref_logp")
    _check(logp, "logp")
    if ref_logp.shape != logp.shape:
        raise ValueError(f"ref_logp {tuple(ref_logp.shape)} and logp {tuple(logp.shape)} differ in shape")
    ref_logp = ref_logp.double()
    kl = (ref_logp.exp() * (ref_logp - logp.double())).sum(dim=1)
    return kl.clamp_min(0.0)


def top1_agreement(ref_logp: torch.Tensor, logp: torch.Tensor) -> float:
    """Fraction of steps whose argmax token equals the reference's."""
    _check(ref_logp, "ref_logp")
    _check(logp, "logp")
    return (ref_logp.argmax(dim=1) == logp.argmax(dim=1)).double().mean().item()


def top1_accuracy(logp: torch.Tensor, targets: torch.Tensor) -> float:
    """Fraction of steps whose argmax token equals the target (the recall probe's score)."""
    _check(logp, "logp")
    return (logp.argmax(dim=1) == targets.view(-1).long()).double().mean().item()


def compare(ref_logp: torch.Tensor, logp: torch.Tensor, targets: torch.Tensor) -> dict:
    """All accuracy metrics of one window against the reference. JSON-able floats."""
    ppl_ref = perplexity(ref_logp, targets)
    ppl = perplexity(logp, targets)
    return {
        "ppl": ppl,
        "ppl_ref": ppl_ref,
        "ppl_rel_change": ppl / ppl_ref - 1.0,
        "kl_mean": kl_divergence(ref_logp, logp).mean().item(),
        "top1_agreement": top1_agreement(ref_logp, logp),
    }


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points not dominated when lower x (bytes) and lower y (error) are both better.

    Returned in increasing x. Ties in x keep only the lowest y.
    """
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best_y = math.inf
    for i in order:
        if points[i][1] < best_y:
            front.append(i)
            best_y = points[i][1]
    return front


def bootstrap_ci(values, seed: int, level: float = 0.95, resamples: int = 2000) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (resampled with replacement).

    Seeded: the same values and seed give the same interval. One value gives a zero-width interval.
    """
    import numpy as np

    x = np.asarray(values, dtype=np.float64)
    if x.size == 0:
        return float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(resamples, x.size))].mean(axis=1)
    a = (1.0 - level) / 2
    return float(np.quantile(means, a)), float(np.quantile(means, 1.0 - a))


def mean_ci(values, seed: int) -> dict:
    """``{"mean", "lo", "hi", "n"}``: the mean and its 95% bootstrap interval."""
    lo, hi = bootstrap_ci(values, seed)
    return {"mean": float(sum(values) / len(values)) if values else float("nan"), "lo": lo, "hi": hi,
            "n": len(values)}


def paired_diff(ref_values, values, seed: int) -> dict:
    """The paired difference ``values - ref_values`` (same samples), its 95% bootstrap interval,
    and ``within_ci``: whether zero lies inside it (the difference is not distinguishable)."""
    if len(ref_values) != len(values):
        raise ValueError(f"paired values must have the same length; got {len(ref_values)} and {len(values)}")
    d = mean_ci([b - a for a, b in zip(ref_values, values)], seed)
    d["within_ci"] = bool(d["lo"] <= 0.0 <= d["hi"])
    return d


def ratio_ci(ref_values, values, seed: int, level: float = 0.95, resamples: int = 2000) -> dict:
    """``mean(values) / mean(ref_values)`` on the same samples, with a paired percentile-bootstrap
    interval (each resample draws sample indices and takes both means over them; a resample whose
    reference mean is 0 is dropped). ``{"mean", "lo", "hi", "n"}``; nan when the reference mean is 0."""
    import numpy as np

    if len(ref_values) != len(values):
        raise ValueError(f"paired values must have the same length; got {len(ref_values)} and {len(values)}")
    r, x = np.asarray(ref_values, dtype=np.float64), np.asarray(values, dtype=np.float64)
    nan = float("nan")
    if r.size == 0 or r.mean() == 0:
        return {"mean": nan, "lo": nan, "hi": nan, "n": int(r.size)}
    idx = np.random.default_rng(seed).integers(0, r.size, size=(resamples, r.size))
    rm, xm = r[idx].mean(axis=1), x[idx].mean(axis=1)
    keep = rm > 0
    ratios = xm[keep] / rm[keep]
    a = (1.0 - level) / 2
    return {"mean": float(x.mean() / r.mean()), "lo": float(np.quantile(ratios, a)),
            "hi": float(np.quantile(ratios, 1.0 - a)), "n": int(r.size)}
