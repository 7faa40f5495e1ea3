"""Runs every configuration on one sample, from one shared prefill, the way generation does.

    sample --prefill once (DynamicCache)--> Prefill
           --for each configuration: build its cache from the Prefill (caches.Run)-->
               text window:  teacher-force the continuation one token at a time -> log-probs
               RULER sample: greedy decode until EOS, RULER's score is reached, or the task's
                             token limit -> prediction, RULER's score
                             (fidelity: a second, fresh cache replays the reference's answer
                             tokens -> log-probs compared with the reference's, step by step)

Decode steps pass explicit positions, so caches that dropped tokens (StreamingLLM, SnapKV) keep
each new token at its true position. A RULER decode may stop as soon as RULER's score reaches
1.0: its string-match metrics can only count references that appear, so more tokens cannot
change the score.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvtier.eval import extract, metrics, ruler
from kvtier.eval.caches import CacheSpec, Prefill, Run, Unavailable, prefill
from kvtier.eval.data import Window


@dataclass
class Result:
    """One configuration on one sample."""

    spec: CacheSpec
    sample: object                  # Window | ruler.Sample
    step_s: list
    prefill_s: float                # the prefill this configuration started from
    build_s: float                  # building its cache from the shared prefill
    footprint: dict
    stats: dict
    logp: torch.Tensor | None = None  # text window: [M, vocab] float32 log-probs
    prediction: str | None = None     # RULER: the decoded answer
    score: float | None = None        # RULER: its score in [0, 1]
    partial: float | None = None      # RULER: per reference, the longest prefix copied (extract.partial)
    tokens: list = field(default_factory=list)
    fidelity: dict | None = None      # RULER with fidelity: {"kl", "top1", "steps"} along the reference's answer

    @property
    def ttft_s(self) -> float:
        return self.prefill_s + self.build_s


def snapkv_window(specs: list[CacheSpec]) -> int:
    """The observation window the shared prefill must capture queries for (0: no snapkv row)."""
    return max((s.params.get("window_tokens", 32) for s in specs if s.kind == "snapkv"), default=0)


@torch.inference_mode()
def run_all(model, specs: list[CacheSpec], sample, workdir: Path, tokenizer=None, max_new_tokens=None,
            on_result=None, prefill_cache: Path | None = None, fidelity: bool = False) -> list[Result]:
    """Every spec on ``sample`` (a text :class:`Window` or a :class:`ruler.Sample`).

    ``prefill_cache``: a directory where the shared prefill is kept and reused (see :func:`prefill`).
    ``fidelity`` (RULER samples): every spec after the first (the reference) also replays the
    reference's answer tokens on a cache built afresh, and its ``fidelity`` holds the mean KL from
    the reference's next-token distribution and the share of steps whose argmax is the reference's
    token. A greedy score moves only where a step's top two tokens trade places; this measures every
    step of every sample, so a few samples separate configurations a score cannot.

    Returns one entry per spec: its :class:`Result`, or the :class:`Unavailable` it raised
    (a configuration this machine cannot run).
    """
    ids = sample.context if isinstance(sample, Window) else sample.input_ids
    pre = prefill(model, ids, snapkv_window(specs), cache_dir=prefill_cache)
    replay = fidelity and not isinstance(sample, Window)
    out = []
    for i, spec in enumerate(specs):
        try:
            r = _run_one(model, spec, sample, ids, pre, workdir, tokenizer, max_new_tokens, keep_logp=replay)
            ref = out[0] if out else None
            if replay and i > 0 and isinstance(ref, Result):
                # A row whose greedy answer is the reference's, token for token, was fed exactly
                # what a replay would feed (same fresh cache, positions and steps; the decode is
                # deterministic): its own log-probs are the replay's.
                along = r if r.tokens == ref.tokens else _run_one(
                    model, spec, sample, ids, pre, workdir, tokenizer, max_new_tokens, along=ref.tokens)
                r.fidelity = _fidelity(ref, along.logp)
            if replay and i > 0:
                r.logp = None  # kept for the replay only (a text window's log-probs are its result)
        except Unavailable as e:
            r = e
        out.append(r)
        if on_result:
            on_result(r)
    if replay and isinstance(out[0], Result):
        out[0].logp = None  # [steps, vocab] floats a sample: not kept across a run's samples
    return out


def _fidelity(ref: Result, logp: torch.Tensor) -> dict:
    """One configuration's replay of the reference's answer against the reference's own steps."""
    return {"kl": metrics.kl_divergence(ref.logp, logp).mean().item(),
            "top1": metrics.top1_accuracy(logp, torch.tensor(ref.tokens)), "steps": len(ref.tokens)}


def _run_one(model, spec, sample, ids, pre: Prefill, workdir, tokenizer, max_new_tokens, keep_logp=False,
             along: list | None = None) -> Result:
    """``spec`` on ``sample``; a RULER sample is decoded greedily (``keep_logp``: with each step's
    log-probs) or, given ``along``, fed those tokens (teacher-forced) for their log-probs."""
    context = ids.numel()
    run = Run(spec, model, pre, context, workdir)
    try:
        if spec.reuses_prefill:
            logits, prefill_s = pre.logits, pre.seconds
        else:
            t0 = time.perf_counter()
            o = model(input_ids=ids.view(1, -1), cache=run.cache, use_cache=True, logits_to_keep=1)
            prefill_s = time.perf_counter() - t0
            logits = o.logits[0, -1].float()
        if isinstance(sample, Window):
            r = _teacher_forced(model, run, sample, context, logits, sample.continuation.tolist())
        elif along is not None:
            r = _teacher_forced(model, run, sample, context, logits, along)
        else:
            r = _greedy(model, run, sample, context, logits, tokenizer, max_new_tokens or sample.max_new_tokens,
                        keep_logp)
        r.prefill_s = prefill_s
        r.build_s = run.build_s
        r.footprint = run.footprint(context + max(1, len(r.step_s)))
        r.stats = run.stats()
        return r
    finally:
        run.close()


def _step(model, run: Run, token: int, pos: int) -> torch.Tensor:
    out = model(input_ids=torch.tensor([[token]]), position_ids=torch.tensor([[pos]]), cache=run.cache,
                use_cache=True)
    run.after_step()
    return out.logits[0, -1].float()


def _teacher_forced(model, run, sample, context, first_logits, tokens: list) -> Result:
    """Feeds ``tokens`` (a text window's continuation, or another configuration's answer) one
    step at a time: the log-probs each step gives the next of them, ``[len(tokens), vocab]``."""
    logits, steps = [first_logits], []
    for t, tok in enumerate(tokens[:-1]):
        run.settle()
        t0 = time.perf_counter()
        logits.append(_step(model, run, tok, context + t))
        steps.append(time.perf_counter() - t0)
    return Result(run.spec, sample, steps, 0.0, 0.0, {}, {}, logp=torch.log_softmax(torch.stack(logits), dim=-1))


def stop_tokens(tokenizer) -> set[int]:
    """The tokens that end a RULER answer: EOS, and the chat end-of-turn token."""
    eos = tokenizer.eos_token_id
    stop = set(eos if isinstance(eos, list) else [eos])
    # chat models end a turn with their end-of-turn token, which need not be the EOS token
    end_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    if end_turn is not None and end_turn != tokenizer.unk_token_id:
        stop.add(end_turn)
    stop.discard(None)
    return stop


def _greedy(model, run, s: ruler.Sample, context, first_logits, tokenizer, limit: int,
            keep_logp: bool = False) -> Result:
    stop = stop_tokens(tokenizer)
    tokens, steps = [int(first_logits.argmax())], []
    kept = [first_logits] if keep_logp else None
    while True:
        text = tokenizer.decode([t for t in tokens if t not in stop], skip_special_tokens=True)
        score = extract.exact(s.outputs, text) if s.metric == extract.METRIC else ruler.score(s, text)
        if tokens[-1] in stop or score >= 1.0 or len(tokens) >= limit:
            break
        run.settle()
        t0 = time.perf_counter()
        logits = _step(model, run, tokens[-1], context + len(tokens) - 1)
        steps.append(time.perf_counter() - t0)
        tokens.append(int(logits.argmax()))
        if kept is not None:
            kept.append(logits)
    return Result(run.spec, s, steps, 0.0, 0.0, {}, {}, prediction=text, score=score,
                  partial=extract.partial(s.outputs, text), tokens=tokens,
                  logp=torch.log_softmax(torch.stack(kept), dim=-1) if kept is not None else None)
