"""Token windows of real text, and the long-range recall probe built from them.

::

    natural window:  [ context: C tokens of text          ][ continuation: M tokens ]
                                                            ^ teacher-forced, scored
    probe window:    [ text ... | cue P | text ...          | cue P[:k] ][ P[k:] ]
                              depth d                                      ^ scored

The probe only succeeds if the block holding ``cue P`` (at depth ``d``) is attended to when
the end is decoded, wherever that block was evicted to.
"""
from __future__ import annotations

import random
import re
from dataclasses import dataclass

import torch

PROBE_CUE = " The secret passphrase is:"


@dataclass(frozen=True)
class Window:
    kind: str                 # "text" | "probe"
    context: torch.Tensor     # [C] token ids
    continuation: torch.Tensor  # [M] token ids, fed one at a time and scored
    depth: float = 0.0        # probe: where the passage sits, as a fraction of the context


def tokenize(tokenizer, text: str) -> torch.Tensor:
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
    return ids.long()


def text_windows(ids: torch.Tensor, context: int, continuation: int, n: int, seed: int = 0) -> list[Window]:
    """``n`` windows of ``context + continuation`` consecutive tokens at seeded offsets.

    Raises:
        ValueError: when the text is too short for one window.
    """
    span = context + continuation
    if span > ids.numel():
        raise ValueError(f"context+continuation={span} tokens exceeds the text ({ids.numel()} tokens)")
    rng = random.Random(seed * 1_000_003 + context)
    hi = ids.numel() - span
    offsets = sorted(rng.randrange(0, hi + 1) for _ in range(n))
    return [Window("text", ids[o:o + context].clone(), ids[o + context:o + span].clone()) for o in offsets]


def probe_words(text: str, n: int, rng: random.Random) -> list[str]:
    vocab = sorted({w for w in re.findall(r"[a-z]{4,9}", text)})
    if len(vocab) < n:
        raise ValueError(f"the text has {len(vocab)} distinct words; the recall probe needs words={n}")
    return rng.sample(vocab, n)


def probe_windows(tokenizer, text: str, ids: torch.Tensor, context: int, n: int, words: int = 16,
                  seed: int = 0) -> list[Window]:
    """``n`` recall-probe windows of exactly ``context`` tokens each (see module docstring).

    The passage is ``words`` random words from the text's own vocabulary; the first third is given
    at the end as a cue and the remaining tokens are the scored continuation.
    """
    rng = random.Random(seed * 7_919 + context)
    cue = tokenize(tokenizer, PROBE_CUE)
    out = []
    for _ in range(n):
        passage = tokenize(tokenizer, " " + " ".join(probe_words(text, words, rng)))
        k = max(1, passage.numel() // 3)
        insert = torch.cat([cue, passage, tokenize(tokenizer, ".")])
        tail = torch.cat([tokenize(tokenizer, "\n"), cue, passage[:k]])
        filler = context - insert.numel() - tail.numel()
        if filler < 16:
            raise ValueError(f"context={context} is too short for the recall probe (needs > {context - filler + 16})")
        start = rng.randrange(0, ids.numel() - filler)
        body = ids[start:start + filler]
        depth = rng.uniform(0.1, 0.6)
        at = int(depth * filler)
        ctx = torch.cat([body[:at], insert, body[at:], tail])
        assert ctx.numel() == context, f"probe context {ctx.numel()} != {context}"
        out.append(Window("probe", ctx, passage[k:].clone(), depth=at / context))
    return out
