"""Why a sparse step loses a long answer: per decode step and layer, what the selection took
against what full attention looks at.

For each sample: one shared prefill (kept with --prefill-cache), the reference decode and a
kvtier sparse decode (the same configuration `kvtier eval` runs). During the sparse decode every
``KVStore.select`` call is recorded with its query; afterwards each recorded query is scored
against the exact prompt keys of the shared prefill, per kv head:

    oracle mass   attention mass of the prompt's sealed blocks outside sinks/window (per kv head)
    recall        share of that mass in the blocks the selection took (per kv head, then min/mean)
    value blocks  whether the blocks holding the asked value's tokens were taken
    exact top     recall of the same number of blocks taken by exact attention mass (the heavier
                  kv head's): what any ranking could reach within this budget
    A/B/C d       recall of rankings computed here from exact key centroids of d tokens: A the
                  product's rule (softmax over the candidates' centroids, best part, best query
                  row and head), B the block's estimated mass (parts summed, softmax over every
                  sealed part, best row and head), C B summed over kv heads

    python research/selection_trace.py --tasks extract_hex --samples 2 --hot 0.03 --prefill-cache ~/.cache/kvtier/prefill
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-coder-0.5b")
    p.add_argument("--tasks", default="extract_hex")
    p.add_argument("--samples", type=int, default=2)
    p.add_argument("--context", type=int, default=8192)
    p.add_argument("--hot", type=float, default=0.03)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--prefill-cache", default=None)
    p.add_argument("--params", default="{}", help="extra kvtier config fields (JSON)")
    p.add_argument("--out", default="/tmp/selection_trace.json")
    a = p.parse_args(argv)

    from kvtier.eval import extract, ruler
    from kvtier.eval.runner import run_all
    from kvtier.eval.sweep import REFERENCE, _kv
    from kvtier.hardware import parse_dtype
    from kvtier.models import load_model, model_dir
    from kvtier.store import KVStore

    model, tok = load_model(a.model, dtype=parse_dtype(a.dtype))
    model.eval()
    samples = []
    for t in a.tasks.split(","):
        if t in extract.EXTRACT_TASKS:
            samples += extract.generate(t, tok, a.context, a.samples, seed=42 + a.seed)
        else:
            samples += ruler.generate(t, tok, model_dir(a.model), a.context, a.samples, seed=42 + a.seed)
    spec = _kv("sparse", codec="int4", attention="sparse", device_fraction=a.hot, host_fraction=0.02, policy="lru",
               **json.loads(a.params))
    calls = []
    orig = KVStore.select

    def select(self, seq, layer, query, budget_tokens=None):
        sel = orig(self, seq, layer, query, budget_tokens)
        calls.append((layer, query.detach().float().clone(), list(sel), self.layout.sink_blocks,
                      self.layout.window_blocks, self.layout.block_tokens))
        return sel

    KVStore.select = select
    report = []
    from kvtier.eval.caches import prefill
    for s in samples:
        calls.clear()
        with tempfile.TemporaryDirectory() as tmp:
            res = run_all(model, [REFERENCE, spec], s, Path(tmp), tokenizer=tok,
                          prefill_cache=Path(a.prefill_cache).expanduser() if a.prefill_cache else None)
        pre = prefill(model, s.input_ids, 0, cache_dir=Path(a.prefill_cache).expanduser() if a.prefill_cache else None)
        ref, sp = res
        T = s.input_ids.numel()
        bt = calls[0][5] if calls else 16
        value_blocks = []
        for v in s.outputs:
            try:
                lo, hi = extract.value_spans(tok, s.prompt, [v])[0]
            except ValueError:
                # RULER prompts: find the value's tokens by offsets
                enc = tok(s.prompt, add_special_tokens=False, return_offsets_mapping=True)
                st = s.prompt.index(v)
                idx = [i for i, (x, y) in enumerate(enc["offset_mapping"]) if y > st and x < st + len(v)]
                lo, hi = idx[0], idx[-1]
            value_blocks.append(list(range(lo // bt, hi // bt + 1)))
        nl = model.config.num_hidden_layers
        steps = []
        for i, (layer, q, sel, sink, win, bt) in enumerate(calls):
            step = i // nl
            k = pre.kv[layer][0][0].float()  # [kv_heads, T, hd]
            kvh, _, hd = k.shape
            g = q.shape[0] // kvh
            qq = q.view(kvh, g * q.shape[1], hd)
            att = torch.softmax(qq @ k.transpose(1, 2) * hd ** -0.5, dim=-1)  # [kvh, G, T] (prompt keys only)
            nsealed = T // bt
            per_block = att[:, :, : nsealed * bt].reshape(kvh, -1, nsealed, bt).sum(-1)  # [kvh, G, nb]
            per_head = per_block.amax(1)  # [kvh, nb]: the heaviest query of the group
            cand = torch.zeros(nsealed, dtype=torch.bool)
            cand[sink: max(sink, nsealed - win)] = True
            taken = torch.zeros(nsealed, dtype=torch.bool)
            taken[[b for b in sel if b < nsealed]] = True
            tot = (per_head * cand).sum(1)
            got = (per_head * (cand & taken)).sum(1)
            rec = (got / tot.clamp_min(1e-12)).tolist()
            # what the same number of query-chosen blocks could capture: the top blocks by exact
            # attention mass (the heavier kv head's, per block), the open block aside
            n_taken = int((cand & taken).sum())
            best = torch.zeros(nsealed, dtype=torch.bool)
            if n_taken:
                best[torch.topk((per_head.amax(0) * cand), n_taken).indices] = True
            orec = ((per_head * (cand & best)).sum(1) / tot.clamp_min(1e-12)).tolist()
            rules = {}
            if n_taken:
                for dt in (2, 1):
                    cen = k[:, : nsealed * bt].reshape(kvh, -1, dt, hd).mean(2)  # [kvh, parts, hd]
                    lg = (qq @ cen.transpose(1, 2)) * hd ** -0.5  # [kvh, G, parts]
                    ppb = bt // dt
                    cmask = cand.repeat_interleave(ppb)
                    # A: softmax over candidate parts, best part, best row/head (the product's rule)
                    la = lg.masked_fill(~cmask, float("-inf"))
                    sa = torch.softmax(la, -1).view(kvh, -1, nsealed, ppb).amax(-1).amax(1).amax(0)
                    # B: the block's estimated mass (parts summed, normalised over every sealed part)
                    sb = torch.softmax(lg, -1).view(kvh, -1, nsealed, ppb).sum(-1).amax(1).amax(0)
                    # C: B summed over the kv heads' best rows
                    sc = torch.softmax(lg, -1).view(kvh, -1, nsealed, ppb).sum(-1).amax(1).sum(0)
                    for name, sc_ in (("A", sa), ("B", sb), ("C", sc)):
                        pick = torch.zeros(nsealed, dtype=torch.bool)
                        pick[torch.topk(sc_.masked_fill(~cand, float("-inf")), n_taken).indices] = True
                        rules[f"{name}{dt}"] = min(((per_head * (cand & pick)).sum(1) / tot.clamp_min(1e-12)).tolist())
            # oracle top per head
            top1 = [int(torch.argmax(per_head[h] * cand)) for h in range(kvh)]
            steps.append({"step": step, "layer": layer, "recall": rec, "oracle_recall": orec, "rules": rules,
                          "value_taken": [[b in sel for b in vb] for vb in value_blocks],
                          "oracle_top1": top1, "oracle_top1_taken": [b in sel for b in top1]})
        summary = {}
        for st in steps:
            d = summary.setdefault(st["step"], {"min_recall": [], "value_all": 0, "layers": 0, "top1_missed": 0})
            d["min_recall"].append(min(st["recall"]))
            d.setdefault("oracle_min_recall", []).append(min(st["oracle_recall"]))
            for kk, vv in st["rules"].items():
                d.setdefault(kk, []).append(vv)
            d["value_all"] += all(all(x) for x in st["value_taken"])
            d["top1_missed"] += sum(not x for x in st["oracle_top1_taken"])
            d["layers"] += 1
        lines = [f"step {k}: value blocks all taken in {d['value_all']}/{d['layers']} layers, oracle-top1 missed "
                 f"{d['top1_missed']} (layer x head), min recall median {sorted(d['min_recall'])[len(d['min_recall'])//2]:.2f}"
                 f" (exact top blocks: {sorted(d['oracle_min_recall'])[len(d['oracle_min_recall'])//2]:.2f})" + " " + " ".join(f"{kk} {sorted(d[kk])[len(d[kk])//2]:.2f}" for kk in ("A2", "B2", "C2", "A1", "B1", "C1") if kk in d)
                 for k, d in sorted(summary.items())]
        print(f"== {s.task} #{s.index}: outputs {s.outputs} value blocks {value_blocks}\n ref: {ref.prediction!r} "
              f"({ref.score})\n sparse: {sp.prediction!r} ({sp.score}, partial {sp.partial:.2f})\n  " + "\n  ".join(lines),
              flush=True)
        report.append({"task": s.task, "index": s.index, "outputs": s.outputs, "ref": ref.prediction,
                       "sparse": sp.prediction, "score": sp.score, "ref_score": ref.score, "steps": steps,
                       "value_blocks": value_blocks, "tokens": sp.tokens})
    Path(a.out).write_text(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
