"""Long exact-answer extraction: copy a long random value out of hundreds of look-alikes.

RULER's NIAH answers are short (7-digit numbers, one word) or single UUIDs; a block-sparse cache
can read the first few characters of a long answer and lose the rest (the block holding its
continuation is not selected, or a look-alike's is). These tasks stress exactly that:

    haystack  hundreds of records ``<key> => <value>``: every key and value drawn from one
              alphabet, so every record is a distractor for every other
    question  the value of one key (or of several: ``extract_multi``)
    answer    the value, 18-36 characters, copied verbatim

Kinds (keys and values of different lengths and alphabets):

    extract_hex     UUID keys (36 hex chars)          -> 8-4-4-4 hex values (23 chars)
    extract_b32     base32 keys (16 chars)            -> base32 values (26 chars, groups of 6-7)
    extract_digits  two-word keys (amber-falcon)      -> 20 digits in groups of 5 (23 chars)
    extract_words   8-digit keys                      -> four random words (~30 chars)
    extract_multi   UUID keys -> 18-char hex values, three asked in one prompt

``density`` sets the difficulty: the share of the haystack's tokens that are records, the rest
RULER's essay text (the NIAH haystack) in passages between them. At 1.0 the haystack is all
records (hundreds of look-alikes at 8k: Qwen2.5-Coder-0.5B with full attention copies a
neighbour's value, docs/results/long-answers.md); the default :data:`DENSITY` keeps a few dozen
records at 8k, spread through the essays, so a small model's full attention finds the asked one and
the long copy is what is tested.

Each asked record is placed so that its value's tokens cross a ``block_tokens`` boundary (the
position of a block in kvtier: token index // block_tokens), at depths spread over the context.
Generation is deterministic in (kind, context, n, seed, density, tokenizer, template). Scores: ``exact``
(the fraction of asked values that appear verbatim in the answer: RULER's string_match_all,
case-sensitive) and :func:`partial` (per value, the longest prefix of it that appears, as a
fraction of its length: how far the copy went before it drifted).
"""
from __future__ import annotations

import random
import string

from kvtier.eval.ruler import Sample, chat_template

EXTRACT_TASKS = ("extract_hex", "extract_b32", "extract_digits", "extract_words", "extract_multi")
METRIC = "exact_all"
#: default share of the haystack's tokens in records (the rest essay text between them)
DENSITY = 0.1

_HEX = "0123456789abcdef"
_B32 = string.ascii_uppercase + "234567"
# common, short, unambiguous English words (one or two tokens each in BPE vocabularies)
_WORDS = ("amber apple arrow aspen badge basil beacon birch bison blade bloom bolt cabin camel candle canyon "
          "cedar chalk cliff clover comet coral crane crown dawn delta dune eagle ember falcon fern fig flint "
          "forge fox frost garnet glade glass granite grove harbor hazel heron hollow iris ivory jade jasper "
          "kettle lagoon lantern larch lemon lilac linen lotus maple marble meadow mesa mint moss nectar "
          "oak olive onyx orchid otter pebble pepper pine plum quartz quill raven reef ridge river robin "
          "saffron sage sparrow spruce stone summit swan thistle thorn tide timber topaz tulip tundra valley "
          "velvet violet walnut willow wren yarrow zephyr").split()
_TEMPLATE = ("Below is a table of records. Each line maps a key to its value. Memorize the values; you "
             "will be asked for some of them.\n\n{context}\n\n{question}")
_QUESTION_ONE = "What is the value of key {key}? Copy the value exactly, with nothing else."
_QUESTION_MANY = ("What are the values of keys {keys}? Copy each value exactly, one per line, in the order "
                  "asked, with nothing else.")
_PREFIX_ONE = "The value of key {key} is: "
_PREFIX_MANY = "The values are:\n"


def _hex(rng: random.Random, groups) -> str:
    return "-".join("".join(rng.choice(_HEX) for _ in range(g)) for g in groups)


def _b32(rng: random.Random, groups) -> str:
    return "-".join("".join(rng.choice(_B32) for _ in range(g)) for g in groups)


def _digits(rng: random.Random, groups) -> str:
    return "-".join("".join(rng.choice(string.digits) for _ in range(g)) for g in groups)


# kind -> (key maker, value maker, answers per prompt)
_KINDS = {
    "extract_hex": (lambda r: _hex(r, (8, 4, 4, 4, 12)), lambda r: _hex(r, (8, 4, 4, 4)), 1),
    "extract_b32": (lambda r: _b32(r, (16,)), lambda r: _b32(r, (6, 6, 6, 5)), 1),
    "extract_digits": (lambda r: "-".join(r.sample(_WORDS, 2)), lambda r: _digits(r, (5, 5, 5, 5)), 1),
    "extract_words": (lambda r: _digits(r, (8,)), lambda r: " ".join(r.sample(_WORDS, 4)), 1),
    "extract_multi": (lambda r: _hex(r, (8, 4, 4, 4, 12)), lambda r: _hex(r, (8, 4, 4)), 3),
}


def check_tasks(names: list[str]) -> list[str]:
    bad = [n for n in names if n not in EXTRACT_TASKS]
    if bad:
        raise ValueError(f"--tasks: unknown extraction task(s) {bad}; defined: {list(EXTRACT_TASKS)}")
    return names


def max_new_tokens(kind: str) -> int:
    """Generation limit: room for the values asked (a 36-char value is at most ~25 tokens)."""
    return 32 * _KINDS[kind][2] + 16


def _records(rng: random.Random, kind: str, n: int) -> list[tuple[str, str]]:
    make_key, make_value, _ = _KINDS[kind]
    seen_k, seen_v, out = set(), set(), []
    while len(out) < n:
        k, v = make_key(rng), make_value(rng)
        if k in seen_k or v in seen_v:
            continue
        seen_k.add(k)
        seen_v.add(v)
        out.append((k, v))
    return out


def _render(records, asked, kind, template, filler=None):
    """The prompt; ``filler[i]`` (text or "") goes before record i, ``filler[len(records)]`` after the last."""
    keys = [records[i][0] for i in asked]
    lines = []
    for i, (k, v) in enumerate(records):
        if filler and filler[i]:
            lines.append(filler[i])
        lines.append(f"{k} => {v}")
    if filler and filler[len(records)]:
        lines.append(filler[len(records)])
    body = "\n".join(lines)
    if len(keys) == 1:
        question, prefix = _QUESTION_ONE.format(key=keys[0]), _PREFIX_ONE.format(key=keys[0])
    else:
        question, prefix = _QUESTION_MANY.format(keys=", ".join(keys)), _PREFIX_MANY
    task = _TEMPLATE.format(context=body, question=question)
    # the model template holds {task_template} with its own braces doubled (ruler.chat_template)
    return template.format(task_template=task.replace("{", "{{").replace("}", "}}")) + prefix


def value_spans(tokenizer, prompt: str, values: list[str]) -> list[tuple[int, int]]:
    """Token span [first, last] of each value's first ``=> value`` occurrence in ``prompt``."""
    enc = tokenizer(prompt, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    spans = []
    for v in values:
        start = prompt.index(f"=> {v}\n") + 3
        end = start + len(v)
        toks = [i for i, (a, b) in enumerate(offs) if b > start and a < end]
        spans.append((toks[0], toks[-1]))
    return spans


def crosses(span: tuple[int, int], block_tokens: int) -> bool:
    return span[0] // block_tokens != span[1] // block_tokens


def _essay_sentences() -> list[str]:
    from kvtier.eval.ruler import essays_text, split_sentences

    return [x for x in split_sentences(" ".join(essays_text().split())) if x]


def _filler(sentences: list[str], start: int, cuts: list[float], n_sentences: int) -> list[str]:
    """``n_sentences`` consecutive essay sentences from ``start``, cut at the fractions ``cuts``
    (ascending, one per record) into ``len(cuts) + 1`` passages: one before each record, one after
    the last."""
    text = sentences[start:start + n_sentences]
    edges = [0] + [int(c * len(text)) for c in cuts] + [len(text)]
    return [" ".join(text[a:b]) for a, b in zip(edges, edges[1:])]


def _shift_to_cross(tokenizer, table, asked, slot, kind, template, filler, block_tokens):
    """``filler`` with words moved across asked record ``asked[slot]`` (from the passage before it
    to the one after, or back; the fewest that work) so that its value crosses a block boundary."""
    i = asked[slot]
    before = filler[i].split(" ") if filler[i] else []
    after = filler[i + 1].split(" ") if filler[i + 1] else []
    for d in [x for r in range(64) for x in ((r, -r) if r else (0,))]:
        if d > len(before) or -d > len(after):
            continue
        moved = list(filler)
        moved[i] = " ".join(before[:len(before) - d] if d >= 0 else before + after[:-d])
        moved[i + 1] = " ".join(before[len(before) - d:] + after if d >= 0 else after[-d:])
        if crosses(value_spans(tokenizer, _render(table, asked, kind, template, moved), [table[i][1]])[0],
                   block_tokens):
            return moved
    return filler


def _fit(prompt_tokens, lo: int, hi: int, budget: int) -> int:
    """The largest x in [lo, hi] with prompt_tokens(x) <= budget (prompt_tokens increasing)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if prompt_tokens(mid) <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def generate(kind: str, tokenizer, context: int, n: int, seed: int, template: str | None = None,
             block_tokens: int = 16, density: float = DENSITY) -> list[Sample]:
    """``n`` samples of ``kind`` whose prompt plus answer fit ``context`` tokens.

    Args:
        template: a model template with ``{task_template}`` (default: the tokenizer's chat
            template, as :func:`kvtier.eval.ruler.chat_template`).
        block_tokens: each asked value is placed to straddle a boundary of blocks this long.
        density: share of the haystack's tokens in records, in (0, 1]; the rest is RULER's essay
            text between them (1.0: records only, the hardest).
    """
    check_tasks([kind])
    if context < 512:
        raise ValueError(f"--contexts: extraction tasks need at least 512 tokens; got {context}")
    if isinstance(density, bool) or not isinstance(density, (int, float)) or not 0 < density <= 1:
        raise ValueError(f"--extract-density must be a fraction in (0, 1]; got {density!r}")
    sentences = _essay_sentences() if density < 1 else []
    template = template if template is not None else chat_template(tokenizer)
    limit = max_new_tokens(kind)
    per_prompt = _KINDS[kind][2]
    samples = []
    for index in range(n):
        # one stream per sample: the same (kind, seed, index) gives the same sample whatever n is
        rng = random.Random(f"{kind}/{seed}/{index}")
        # a few tokens of slack: moving an asked record across a block boundary (below) swaps
        # lines whose lengths can differ by a token or two
        budget = context - limit - 4
        records = _records(rng, kind, 4096)

        def tokens(records_n: int, filler=None) -> int:
            return len(tokenizer(_render(records[:records_n], list(range(per_prompt)), kind, template, filler),
                                 add_special_tokens=False)["input_ids"])

        # size the table: the most records whose prompt fits (a line's token count varies) ...
        full = _fit(tokens, per_prompt + 2, len(records), budget)
        filler = None
        if density < 1:
            # ... of which a ``density`` share stays, and essay sentences (a seeded stretch, cut at
            # seeded points) fill the rest of the budget
            full = max(per_prompt + 2, round(density * full))
            start = rng.randrange(len(sentences) // 2)
            cuts = sorted(rng.random() for _ in range(full))
            room = len(sentences) - start
            # a sentence is at least a token: more than ``context`` of them never fit
            k = _fit(lambda x: tokens(full, _filler(sentences, start, cuts, x)), 0, min(room, context), budget)
            filler = _filler(sentences, start, cuts, k)
        table = records[:full]
        # asked records at depths spread over the table, jittered; order asked != order in table
        depths = [(j + rng.random()) / per_prompt for j in range(per_prompt)]
        asked = [min(len(table) - 1, int(d * len(table))) for d in depths]
        rng.shuffle(asked)
        prompt = _render(table, asked, kind, template, filler)
        # put each asked value across a block boundary: move the asked record to the nearest line
        # (swapping it with the record there: the prompt's length barely moves) where it crosses
        for slot in range(per_prompt):
            home = asked[slot]
            tries = [home + d for r in range(len(table)) for d in ((r, -r) if r else (0,))]
            for target in [t for t in tries if 0 <= t < len(table) and t not in asked[:slot] + asked[slot + 1:]]:
                i = asked[slot]
                table[i], table[target] = table[target], table[i]
                asked[slot] = target
                prompt = _render(table, asked, kind, template, filler)
                if crosses(value_spans(tokenizer, prompt, [table[target][1]])[0], block_tokens):
                    break
            else:
                if filler is not None:
                    # few records, none of whose lines crosses: move essay words from the passage
                    # before the record to the one after it (or back), a token or two at a time
                    filler = _shift_to_cross(tokenizer, table, asked, slot, kind, template, filler, block_tokens)
                    prompt = _render(table, asked, kind, template, filler)
        ids = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")["input_ids"][0].long()
        outputs = [table[i][1] for i in asked]
        samples.append(Sample(kind, index, prompt, outputs, limit, METRIC, ids))
    return samples


def exact(outputs: list[str], prediction: str) -> float:
    """Fraction of ``outputs`` that appear verbatim in ``prediction`` (case-sensitive)."""
    return sum(o in prediction for o in outputs) / len(outputs)


def partial(outputs: list[str], prediction: str) -> float:
    """Mean over ``outputs`` of the longest prefix of it found in ``prediction``, over its length."""
    total = 0.0
    for o in outputs:
        lo, hi = 0, len(o)
        while lo < hi:  # prefixes are nested: the longest one found, by bisection
            mid = (lo + hi + 1) // 2
            if o[:mid] in prediction:
                lo = mid
            else:
                hi = mid - 1
        total += lo / len(o)
    return total / len(outputs)
