"""Quantization quality on the real default model (SmolLM2-135M-Instruct, its GGUF's
weights dequantized to float32): perplexity of a fixed text through prompt_logprobs,
for the float model, for jaxllm's own --quantization fp8 and int8 (W8A8: RTN
per-channel weights, per-token activation scales, int8 with a zero point per token and
K rotated in Hadamard blocks unless JAXLLM_INT8_ROTATION=0),
and for 4-bit RTN in asymmetric groups of 128 (written as a GPTQ folder and loaded
through jaxllm's GPTQ path). The issue's bar: FP8 and INT8 within 2% of the float
model's perplexity, judged on two fixed texts together: TEXT below (723 tokens, the
figures' history) and scripts/quality_text.txt (varied prose, a dialogue and code,
added so that the interval can decide the bar). Each row also prints a 95% interval
of its ratio to the float model's, by a block bootstrap over the text
(ratio_interval): how far the text alone could move the figure.

    python scripts/quant_quality.py [--model PATH] [--check]
"""
from __future__ import annotations

import argparse
import math
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

TEXT = """\
The history of the printing press begins in the middle of the fifteenth century, when
Johannes Gutenberg, a goldsmith from Mainz, combined several existing technologies into
a single system. Movable type had been used in East Asia for centuries, and screw presses
were common in the production of wine and olive oil. What Gutenberg added was a method
for casting metal type quickly and accurately, an oil-based ink that adhered to metal, and
a way of organizing the work so that a small team could produce hundreds of identical
pages in a day. The first major book printed this way was a Latin Bible, completed around
1455. Within fifty years, printing shops had spread to more than two hundred cities across
Europe, and millions of books were in circulation.

The consequences were enormous. Books became cheaper, so more people learned to read.
Scholars could compare identical copies of a text, which made it easier to find and
correct errors. Ideas travelled faster than ever before: a pamphlet written in one city
could be reprinted in another within weeks. Historians often link the press to the
Reformation, the Scientific Revolution and the growth of modern science, because each of
these movements depended on the rapid exchange of written arguments and data.

Today we face a similar change. Computers allow anyone to publish text, images and
programs to a global audience at almost no cost. Just as with the printing press, the new
technology brings both opportunities and problems. Information is abundant, but attention
is scarce, and it can be hard to tell reliable sources from unreliable ones. Learning to
read carefully, to check claims against evidence, and to think about who benefits from a
message remains as important now as it was five hundred years ago.

Photosynthesis is the process by which plants, algae and some bacteria turn light into
chemical energy. In the chloroplasts of a leaf, pigments such as chlorophyll absorb red
and blue light and use its energy to split water molecules. The oxygen released in this
step escapes into the air, while the hydrogen is used, together with carbon dioxide taken
from the atmosphere, to build sugars. These sugars feed the plant and, through food
chains, nearly every other living thing on Earth. Scientists estimate that photosynthesis
captures about one hundred terawatts of power, several times the total energy used by
human civilization.

"Could you help me plan a trip to the mountains next weekend?" asked Maria.
"Of course," replied the assistant. "How many days do you have, and do you prefer hiking,
skiing, or simply relaxing by a lake?"
"Two days, and I would like an easy hike with a nice view."
"Then I suggest leaving early on Saturday, taking the train to the valley, and walking
the lakeside trail to the old mountain hut. It takes about three hours, the path is wide
and well marked, and you can spend the night there before returning on Sunday."

To compute the average of a list of numbers in Python, add them up and divide by their
count: def mean(values): return sum(values) / len(values). For an empty list this raises
a ZeroDivisionError, so a careful program checks the length first, or returns None when
there is nothing to average. The median is less sensitive to outliers: sort the values
and take the middle one, or the mean of the two middle ones when the count is even.
"""

MODES = [("float", None), ("fp8", "fp8"), ("int8", "int8")]
PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


BLOCK = 32     # tokens per bootstrap block (ratio_interval)
LONG_TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "quality_text.txt")


def _long_text() -> str:
    with open(LONG_TEXT) as f:
        return f.read()


def write_gptq_g128(gguf_path: str, folder: str) -> None:
    """The GGUF's float weights with every projection RTN-quantized to 4 bits in
    asymmetric groups of 128 (f16 scales), saved as a GPTQ v2 folder (qweight packed
    along K, qzeros along N, 8 values to an int32, low bits first), so jaxllm loads it
    through its GPTQ path."""
    import json

    import numpy as np
    from safetensors.numpy import save_file

    from jaxllm.models.gguf_loader import open_gguf
    gg = open_gguf(gguf_path)
    cfg = gg.hf_config()
    tensors = {}
    for name in gg.tensors:
        w = gg.get(name)
        if not any(f".{p}." in name for p in PROJ):
            tensors[name] = w.astype(np.float32)
            continue
        n, k = w.shape
        gid = np.arange(k) // 128          # SmolLM2's 576 ends in a group of 64
        groups = range(gid[-1] + 1)
        lo = np.stack([np.minimum(w[:, gid == j].min(1), 0) for j in groups], 1)
        hi = np.stack([np.maximum(w[:, gid == j].max(1), 0) for j in groups], 1)
        s = ((hi - lo) / 15).astype(np.float16).astype(np.float32)
        s = np.where(s == 0, np.float32(1e-4), s)
        z = np.clip(np.round(-lo / s), 0, 15)
        q = np.clip(np.round(w / s[:, gid]) + z[:, gid], 0, 15).astype(np.uint32)
        base = name[:-len("weight")]
        tensors[base + "qweight"] = _pack(q.T, axis=0)
        tensors[base + "qzeros"] = _pack(z.astype(np.uint32).T, axis=1)
        tensors[base + "scales"] = s.T.astype(np.float16)
    os.makedirs(folder, exist_ok=True)
    save_file({n: np.ascontiguousarray(t) for n, t in tensors.items()},
              os.path.join(folder, "model.safetensors"))
    cfg["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": 128,
                                  "desc_act": False, "sym": False,
                                  "checkpoint_format": "gptq_v2"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    gg.tokenizer().save_pretrained(folder)


def _pack(v, axis: int):
    import numpy as np
    if axis == 0:
        return _pack(v.T, 1).T
    v = v.reshape(v.shape[0], -1, 8)
    words = np.zeros(v.shape[:2], np.uint32)
    for i in range(8):
        words |= v[..., i] << np.uint32(4 * i)
    return words.view(np.int32)


def token_logprobs(llm, token_ids) -> list[float]:
    """The logprob of each token after the first, given the ones before it."""
    from jaxllm import SamplingParams
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": token_ids}], params, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][t].logprob for i, t in enumerate(token_ids) if i > 0]


def perplexity(lps) -> float:
    return math.exp(-sum(lps) / len(lps))


def ratio_interval(lps, base_lps, block: int = BLOCK, draws: int = 2000, seed: int = 0):
    """A 95% interval of perplexity(lps) / perplexity(base_lps) - 1 by a paired moving-
    block bootstrap over the text's positions: resampling blocks of `block` consecutive
    tokens (both runs at the same positions) keeps the text's local correlation, which
    resampling single tokens would ignore and so understate the spread."""
    import numpy as np
    d = np.asarray(base_lps) - np.asarray(lps)          # per-token NLL increase
    n = len(d)
    starts = np.random.default_rng(seed).integers(0, n - block + 1,
                                                 (draws, -(-n // block)))
    idx = (starts[:, :, None] + np.arange(block)).reshape(draws, -1)[:, :n]
    lo, hi = np.percentile(np.exp(d[idx].mean(axis=1)) - 1, [2.5, 97.5])
    return float(lo), float(hi)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="model path (default: the embedded GGUF)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless fp8 and int8 are within 2%% of float")
    args = ap.parse_args(argv)
    import tempfile

    from jaxllm import LLM
    from jaxllm.models.gguf_loader import default_model_path
    lps = {}                 # mode -> per text, its tokens' logprobs
    texts = None
    gguf = args.model or default_model_path()
    tmp = tempfile.mkdtemp(prefix="jaxllm-w4g128-")
    modes = MODES + ([("w4 g128", "gptq")] if gguf.endswith(".gguf") else [])
    for name, quantization in modes:
        model = args.model
        if quantization == "gptq":     # RTN into a GPTQ folder, loaded as a checkpoint
            write_gptq_g128(gguf, tmp)
            model, quantization = tmp, None
        llm = LLM(model, dtype="float32", max_model_len=4096, enforce_eager=True,
                  quantization=quantization, compilation_cache_dir=None)
        if texts is None:
            tok = llm.get_tokenizer()
            texts = {"short": tok.encode(TEXT), "long": tok.encode(_long_text())}
        lps[name] = {t: token_logprobs(llm, ids) for t, ids in texts.items()}
        del llm
    print(f"model: {args.model or 'default (SmolLM2-135M-Instruct GGUF, dequantized)'}; "
          f"texts: short {len(texts['short'])} tokens (TEXT), long {len(texts['long'])} "
          f"({LONG_TEXT}); both: all their tokens")
    print(f"{'text':<6} {'weights':<8} {'perplexity':>11} {'vs float':>9}  95% interval "
          f"(blocks of {BLOCK} tokens)")
    results = {}
    for text in ("short", "long", "both"):
        pick = (lambda d: d["short"] + d["long"]) if text == "both" else (lambda d: d[text])
        base = perplexity(pick(lps["float"]))
        for name in lps:
            results[text, name] = ppl = perplexity(pick(lps[name]))
            lo, hi = ratio_interval(pick(lps[name]), pick(lps["float"]))
            print(f"{text:<6} {name:<8} {ppl:>11.4f} {100 * (ppl / base - 1):>+8.2f}%  "
                  f"{100 * lo:+.2f}% .. {100 * hi:+.2f}%")
    # The bar is judged on both texts together, the more tokens the narrower the interval.
    base = results["both", "float"]
    ok = all(results["both", n] <= base * 1.02 for n in ("fp8", "int8"))
    if args.check and not ok:
        print("FAIL: fp8 or int8 is more than 2% above float", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
