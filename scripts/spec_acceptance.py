"""Speculative-decoding acceptance with real weights: the default model
(SmolLM2-135M-Instruct, its Q4_1 GGUF dequantized to float32) with n-gram lookup and
with a draft made of its own first layers.

    python scripts/spec_acceptance.py                     # all of the below
    python scripts/spec_acceptance.py --max-tokens 64 --methods ngram

Prompts (fixed texts below, sent through the model's chat template by LLM.chat):
- code editing, 8: four Python functions (CODE) x two edits each (CODE_TASKS: rename
  an identifier / add type hints and a docstring); the code is in the prompt, so the
  answer mostly repeats it.
- summarisation / retrieval, 8: four passages of 160-190 words (PASSAGES) x two asks
  (summarise it in three sentences / quote the sentence that says a given fact).
Every request greedy (temperature 0), max_tokens 128 (--max-tokens), stopped early
only by the end-of-turn token. Each kind is one LLM.chat call of 8 requests with
max_num_seqs 8, so speculation stays on (disable_by_batch_size is 32).

Configurations, each one LLM of its own: speculation off (the reference outputs);
n-gram k = 2 and 4 with prompt_lookup_min 2, prompt_lookup_max 4; and draft_model
k = 2 and 4 with drafts of L = 4 and 8 of the 30 layers. A draft folder holds the
target's embedding, its first L decoder layers, its final norm and (tied) lm_head,
dequantized from the same GGUF, so the draft is the target cut short ("early exit"),
not a separately trained model. It is written as an HF folder (config.json,
model.safetensors, the tokenizer) to a temp folder.

The engine drafts a request only while speculation pays (spec_decode/policy.py).
By default every decoding request drafts every step (the policy's drafting() is
replaced), which measures raw acceptance; --policy engine keeps the engine's rule.

Printed per configuration and kind (from EngineCore.spec_stats, the difference
across the call): drafts (proposals verified), draft tokens, accepted tokens,
acceptance rate = accepted / draft tokens, mean acceptance length = 1 + accepted /
drafts (tokens a verify step emits, the bonus token included), acceptance per
position, and tokens per target step over the whole decode (n-gram steps with no
match draft nothing: (T - N) / (T - N - A) with T the tokens generated, N requests,
A accepted). Then whether every output's token ids equal speculation off's.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import tempfile
import time

import numpy as np

CODE = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result''',
    '''def parse_config(text):
    config = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config''',
    '''class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise ValueError("not enough " + name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())''',
    '''def merge_intervals(intervals):
    intervals = sorted(intervals)
    merged = []
    for start, end in intervals:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged''',
]
# Per snippet: (old name, new name) for the rename edit.
RENAMES = [("total", "running_sum"), ("config", "settings"), ("items", "stock"),
           ("merged", "result")]
CODE_TASKS = [
    "Here is a Python function:\n\n```python\n{code}\n```\n\nRewrite it with the "
    "variable `{old}` renamed to `{new}`. Keep everything else the same and show the "
    "whole code.",
    "Here is a Python function:\n\n```python\n{code}\n```\n\nAdd type hints and a "
    "short docstring to it. Show the whole code.",
]

PASSAGES = [
    ("The lighthouse on Harrow Point was built in 1872 after three ships ran aground "
     "on the reef in a single winter. Its first keeper, Thomas Avery, lived in the "
     "cottage at its base with his wife and four children. The light was a fixed "
     "white lamp burning whale oil, visible for about fourteen miles in clear weather. "
     "In 1904 the oil lamp was replaced by a kerosene burner, and a rotating lens was "
     "installed so that sailors could tell the light apart from the harbour lamps. "
     "The keepers kept a daily log of the weather, passing ships and repairs, and "
     "these logs survive in the county archive. During the storm of 1931 the sea "
     "broke two windows of the lantern room, and the keeper kept the light burning "
     "by hand for two nights. The station was electrified in 1952 and automated in "
     "1978, when the last keeper left. Today the tower is owned by a local trust, "
     "which opens it to visitors on weekends from May to September. The cottage "
     "houses a small museum with the original lens, the logs and photographs of "
     "the keepers' families.",
     "the lighthouse was automated"),
    ("Sourdough bread is leavened by a culture of wild yeast and lactic acid bacteria "
     "rather than by baker's yeast. The culture, called a starter, is made by mixing "
     "flour and water and leaving it at room temperature for several days, feeding "
     "it with fresh flour and water every day. The bacteria produce lactic and "
     "acetic acids, which give the bread its sour taste and help it keep longer. "
     "The yeast produces carbon dioxide, which makes the dough rise, but more slowly "
     "than commercial yeast, so a sourdough loaf often needs eight to twelve hours "
     "between mixing and baking. Bakers control the sourness through temperature: a "
     "warm dough favours the yeast and tastes milder, while a cool dough favours the "
     "bacteria and tastes more sour. The long fermentation also breaks down some of "
     "the starches and proteins in the flour. A starter can be kept alive for years "
     "if it is fed regularly, and some bakeries claim that their starters are more "
     "than a century old.",
     "bakers control the sourness"),
    ("The town council met on Tuesday to discuss the plan for the new library. The "
     "current library, which opened in 1965, is too small for the town's growing "
     "population and has no space for computers or study rooms. The proposed "
     "building would stand on the site of the old bus depot, next to the park, and "
     "would have three floors, a children's section, a cafe and a meeting hall. "
     "The architect estimated that construction would take two years. The total "
     "cost is expected to be 12 million pounds, of which 8 million would come from a "
     "national grant and the rest from the council's budget. Several residents "
     "spoke against the plan, saying that the depot site floods in heavy rain. The "
     "council's engineer replied that the building would be raised one metre above "
     "the ground and that a new drain would be built along the park. The council "
     "voted seven to two in favour of the plan, and work is expected to start next "
     "spring.",
     "how much the library will cost"),
    ("Honeybees communicate the location of food through a movement known as the "
     "waggle dance. A forager that has found a good source of nectar returns to the "
     "hive and runs in a figure-of-eight pattern on the vertical surface of the comb. "
     "During the straight middle part of the figure, the bee waggles its body from "
     "side to side. The angle of this straight run relative to vertical tells the "
     "other bees the direction of the food relative to the sun. The duration of the "
     "waggle run tells them the distance: the longer the run, the farther away the "
     "food. Other bees follow the dancer closely, touching it with their antennae, "
     "and then fly out to search in the indicated direction. The dance was decoded "
     "by the Austrian scientist Karl von Frisch, who received a Nobel Prize for this "
     "work in 1973. Later studies with radar tracking confirmed that bees which "
     "followed a dance flew straight towards the food described.",
     "the duration of the waggle run means"),
]
SUMMARY_TASKS = [
    "{passage}\n\nSummarise the passage above in three sentences.",
    "{passage}\n\nQuote, word for word, the sentence of the passage above that says "
    "{fact}.",
]


def code_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": task.format(code=code, old=old, new=new)}]
            for code, (old, new) in zip(CODE, RENAMES) for task in CODE_TASKS]


def summary_prompts() -> list[list[dict]]:
    return [[{"role": "user", "content": task.format(passage=p, fact=fact)}]
            for p, fact in PASSAGES for task in SUMMARY_TASKS]


def make_draft_folder(num_layers: int, out_dir: str) -> str:
    """An HF folder of the default model's first `num_layers` layers, its final norm
    and its tied embedding / lm_head, dequantized from the GGUF."""
    from safetensors.numpy import save_file
    from jaxllm.models.gguf_loader import default_model_path, open_gguf
    gg = open_gguf(default_model_path())
    config = dict(gg.hf_config(), num_hidden_layers=num_layers, model_type="llama",
                  torch_dtype="float32")
    keep = [n for n in gg.tensors if not n.startswith("model.layers.")
            or int(n.split(".")[2]) < num_layers]
    save_file({n: np.ascontiguousarray(gg.get(n)) for n in keep},
              os.path.join(out_dir, "model.safetensors"))
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    gg.tokenizer().save_pretrained(out_dir)
    return out_dir


def _force_drafting(core) -> None:
    """Every decoding request drafts every step (raw acceptance)."""
    def drafting(running, decoding, again=False):
        return [r for r in running if decoding(r)]
    core.spec_policy.drafting = drafting


def _stats_diff(after, before) -> dict:
    d = {f: getattr(after, f) - getattr(before, f)
         for f in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    d["per_pos"] = [a - b for a, b in zip(after.num_accepted_tokens_per_pos,
                                          before.num_accepted_tokens_per_pos)]
    return d


def run_config(spec_config, kinds, params, policy: str) -> dict:
    """{kind: (token id lists, stats diff or None)} for one engine."""
    from jaxllm import LLM
    kw = {} if spec_config is None else {"speculative_config": spec_config}
    llm = LLM(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, **kw)
    core = llm.llm_engine.engine_core
    if spec_config is not None and policy == "forced":
        _force_drafting(core)
    results = {}
    for kind, convs in kinds.items():
        before = core.spec_stats.snapshot() if core.spec_stats is not None else None
        t0 = time.perf_counter()
        outs = llm.chat(convs, params, use_tqdm=False)
        secs = time.perf_counter() - t0
        ids = [list(o.outputs[0].token_ids) for o in outs]
        stats = None if before is None else _stats_diff(core.spec_stats, before)
        results[kind] = (ids, stats, secs, outs[0].outputs[0].text)
    del llm, core
    gc.collect()
    return results


def _describe(name, kind, ids, ref_ids, stats) -> dict:
    n = len(ids)
    tokens = sum(len(x) for x in ids)
    same = sum(a == b for a, b in zip(ids, ref_ids))
    first_diff = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q),
                       min(len(a), len(b))) for a, b in zip(ids, ref_ids) if a != b]
    row = {"config": name, "kind": kind, "requests": n, "tokens": tokens,
           "identical": f"{same}/{n}", "first_diff_at": first_diff}
    if stats is not None:
        d, dt, a = stats["num_drafts"], stats["num_draft_tokens"], stats["num_accepted_tokens"]
        decode = tokens - n
        row.update(drafts=d, draft_tokens=dt, accepted=a,
                   acceptance_rate=round(a / dt, 3) if dt else None,
                   mean_acceptance_length=round(1 + a / d, 3) if d else None,
                   per_pos=[round(x / d, 3) for x in stats["per_pos"]] if d else [],
                   tokens_per_target_step=round(decode / max(decode - a, 1), 3))
    return row


def spec_configs(methods, ks, layers, tmp) -> list[tuple[str, dict]]:
    out = []
    if "ngram" in methods:
        out += [(f"ngram k={k}", {"method": "ngram", "num_speculative_tokens": k,
                                  "prompt_lookup_min": 2, "prompt_lookup_max": 4})
                for k in ks]
    if "draft" in methods:
        for n in layers:
            folder = make_draft_folder(n, tempfile.mkdtemp(prefix=f"draft{n}_", dir=tmp))
            out += [(f"draft {n}/30 layers k={k}",
                     {"method": "draft_model", "model": folder, "num_speculative_tokens": k})
                    for k in ks]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--methods", default="ngram,draft", help="ngram, draft or both")
    ap.add_argument("--ks", default="2,4")
    ap.add_argument("--draft-layers", default="4,8")
    ap.add_argument("--policy", choices=("forced", "engine"), default="forced",
                    help="forced: every decoding request drafts every step")
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args()
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    kinds = {"code": code_prompts(), "summary": summary_prompts()}
    ks = [int(x) for x in args.ks.split(",")]
    layers = [int(x) for x in args.draft_layers.split(",")]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ref = run_config(None, kinds, params, args.policy)
        for kind, (ids, _, secs, text) in ref.items():
            print(f"# off {kind}: {sum(map(len, ids))} tokens in {secs:.1f} s; "
                  f"first output: {text[:300]!r}", flush=True)
        for name, sc in spec_configs(args.methods.split(","), ks, layers, tmp):
            res = run_config(sc, kinds, params, args.policy)
            for kind, (ids, stats, secs, _) in res.items():
                row = _describe(name, kind, ids, ref[kind][0], stats)
                row["seconds"] = round(secs, 1)
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
