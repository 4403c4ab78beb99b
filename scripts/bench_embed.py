"""Embedding throughput: jaxllm's pooling runner against sentence-transformers on the
same device, the same random weights and the same texts (issue 21).

    python scripts/bench_embed.py --model qwen3-embedding-0.6b          # 1,000,000 texts
    python scripts/bench_embed.py --model bge-base-en-v1.5 --num 10000  # quick; CPU too
    python scripts/bench_embed.py --model all --num 200000 --st-num 50000

Models: the shapes in configs/models/<name>/config.json, random weights
(transformers' own initialisation, torch seed 0) saved once in the bench dtype to a
temp folder, with a word-level tokenizer (word k is one token, so a text of n words
is n tokens plus the model's special tokens: [CLS] .. [SEP] for bge, an appended
<|endoftext|> for Qwen3-Embedding) and sentence-transformers' own modules.json
(bge: CLS + Normalize; Qwen3-Embedding: last token + Normalize).

Texts: numpy default_rng(--seed): n_words uniform in [8, 64], each word uniform over
the tokenizer's words; the warm-up texts come from seed + 1.

jaxllm: LLM(folder, runner="pooling").embed(texts), wall clock from the strings to
the output objects (tokenizing included), after a warm-up run that compiles the step
shapes. sentence-transformers: torch in the same dtype, encode(batch_size=32, its
default; it sorts by length itself), after a warm-up; --st-num texts (a prefix of the
same list) when the whole list would take too long. Both give float32 vectors; their
cosine over the first texts is printed as a check that both ran the same model.

Before the warm-up, every (B, T) step shape that the warm-up and the timed run will
use (the runner's own plan over the texts' token counts) is lowered and compiled on
threads into jax's persistent cache (a temp folder unless --compilation-cache-dir):
the warm-up's dispatches then load them from disk, and the timed run compiles
nothing, not even its one partial step. XLA compiles outside the GIL, so the shapes
compile side by side instead of one after another.

--profile REPS, after the timed run: each of its step shapes run bare REPS times on
a device-resident input (the plan's device-only seconds: what the run would take
if the host cost nothing), the tokenizer alone on up to 100,000 texts (host texts/s),
the plan's padded fraction, and, where the runner uses cuDNN's attention, the
commonest shape with the jnp attention instead (ms and the vectors' cosine).

Prints each stage's seconds as it ends, one line per model, and writes
$OUT/bench_embed.json (rewritten after each stage, so a run cut short keeps what it
measured) when OUT is set. Needs no network: everything is made here.
"""
from __future__ import annotations

import argparse
import collections
import concurrent.futures
import json
import os
import sys
import tempfile
import time

# JAX takes 75% of a GPU's memory at its first use; torch runs first here and needs
# some of it back afterwards for nothing, but keep JAX from starving it if reordered.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.6")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

import numpy as np  # noqa: E402

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)

MODELS = {"qwen3-embedding-0.6b": "lasttoken", "bge-base-en-v1.5": "cls"}
ALIASES = {"qwen3": "qwen3-embedding-0.6b", "qwen3-0.6b": "qwen3-embedding-0.6b",
           "bge": "bge-base-en-v1.5", "bge-base": "bge-base-en-v1.5"}


T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[bench_embed {time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def save(rows: list[dict]) -> None:
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_embed.json"), "w") as f:
            json.dump(rows, f, indent=1)


def make_texts(n: int, seed: int, words: int) -> list[str]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 65, n)
    ids = rng.integers(0, words, int(lengths.sum()))
    vocab = np.array([f"w{i}" for i in range(words)], dtype=object)
    ends = np.cumsum(lengths)
    return [" ".join(vocab[ids[e - k:e]]) for e, k in zip(ends.tolist(), lengths.tolist())]


def build_tokenizer(folder: str, encoder: bool, words: int) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    specials = (["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] if encoder
                else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    vocab = {t: i for i, t in enumerate(specials)}
    vocab.update({f"w{i}": len(specials) + i for i in range(words)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token=specials[1] if encoder else specials[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    if encoder:
        tok.post_processor = processors.TemplateProcessing(
            single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
        kw = dict(pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]",
                  mask_token="[MASK]")
    else:
        tok.post_processor = processors.TemplateProcessing(
            single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", 0)])
        kw = dict(eos_token="<|endoftext|>", pad_token="<|endoftext|>", padding_side="left")
    PreTrainedTokenizerFast(tokenizer_object=tok, model_max_length=512, **kw
                            ).save_pretrained(folder)


def build_folder(name: str, dtype: str, root: str) -> tuple[str, int]:
    """A folder of random weights, tokenizer and sentence-transformers files."""
    import torch
    import transformers as tf
    from sentence_transformers import SentenceTransformer, models
    with open(os.path.join(REPO, "configs", "models", name, "config.json")) as f:
        hf = json.load(f)
    encoder = hf["architectures"][0] == "BertModel"
    words = min(hf["vocab_size"] - 16, 50000)
    torch.manual_seed(0)
    cfg = tf.AutoConfig.for_model(**hf)
    tdtype = getattr(torch, dtype)
    # Initialised on the GPU where there is one: 600M normal draws are CPU-bound.
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        try:
            model = tf.AutoModel.from_config(cfg, dtype=tdtype)
        except TypeError:       # transformers before 4.56 spells it torch_dtype
            model = tf.AutoModel.from_config(cfg, torch_dtype=tdtype)
    raw = os.path.join(root, name + "-raw")
    model.save_pretrained(raw)
    del model
    build_tokenizer(raw, encoder, words)
    transformer = models.Transformer(raw, max_seq_length=512)
    pooling = models.Pooling(hf["hidden_size"], pooling_mode=MODELS[name])
    folder = os.path.join(root, name)
    SentenceTransformer(modules=[transformer, pooling, models.Normalize()], device="cpu"
                        ).save(folder)
    with open(os.path.join(folder, "config.json")) as f:      # keep the original arch name
        saved = json.load(f)
    saved["architectures"] = hf["architectures"]
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(saved, f)
    return folder, words


def bench_st(folder: str, dtype: str, texts: list[str], warm: list[str], batch_size: int):
    import torch
    from sentence_transformers import SentenceTransformer
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tdtype = getattr(torch, dtype)
    try:
        st = SentenceTransformer(folder, device=device, model_kwargs={"torch_dtype": tdtype})
    except TypeError:           # sentence-transformers before 3.0
        st = SentenceTransformer(folder, device=device)
    st.to(tdtype)
    log(f"sentence-transformers loaded on {device}")
    # As tensors, made float32 here: older versions cannot turn bf16 into numpy.
    st.encode(warm, batch_size=batch_size, convert_to_tensor=True, show_progress_bar=False)
    t0 = time.perf_counter()
    vectors = st.encode(texts, batch_size=batch_size, convert_to_tensor=True,
                        show_progress_bar=False).float().cpu().numpy()
    seconds = time.perf_counter() - t0
    log(f"sentence-transformers: {len(texts):,} texts in {seconds:.1f} s")
    del st
    if device == "cuda":
        torch.cuda.empty_cache()
    return seconds, np.asarray(vectors, np.float32), device


def token_counts(llm, texts: list[str]) -> np.ndarray:
    """Each text's token count: its words plus the model's special tokens (each word
    is one token), without tokenizing."""
    from jaxllm.pooling.params import PoolingParams
    first = texts[0]
    specials = len(llm.llm_engine.tokenize([first], PoolingParams())[0]) - len(first.split())
    return np.fromiter((t.count(" ") + 1 + specials for t in texts), np.int32, len(texts))


def precompile(llm, groups: list[list[str]], extra: tuple = ()) -> tuple[int, float]:
    """Compile every step shape the runner's plan gives for each group of texts into
    the persistent cache, side by side, and the (t, b, attention) steps in `extra`.
    Returns (shapes, seconds)."""
    runner = llm.llm_engine.runner
    shapes = set()
    for texts in groups:
        shapes |= {(t, b, None) for _, t, b in runner.plan(token_counts(llm, texts))}
    shapes |= set(extra)
    t0 = time.perf_counter()
    # Lowering is Python under the GIL (this thread); each compile goes to a worker.
    with concurrent.futures.ThreadPoolExecutor(min(len(shapes), os.cpu_count() or 1)) as pool:
        futures = [pool.submit(runner.lower_step(np.zeros((b, t + 3), np.int32), a).compile)
                   for t, b, a in sorted(shapes, key=str)]
        for f in futures:
            f.result()
    return len(shapes), time.perf_counter() - t0


def common_shape(llm, texts: list[str]) -> tuple[int, int]:
    """The (T, B) of the timed run's most frequent step."""
    plan = llm.llm_engine.runner.plan(token_counts(llm, texts))
    counts = collections.Counter((t, b) for _, t, b in plan)
    return counts.most_common(1)[0][0]


def step_ms(runner, t: int, b: int, reps: int, attention: str | None = None):
    """Device time of one bare step (rows of t - 3..t random tokens, device-resident
    input, `reps` back to back) and its vectors."""
    import jax
    rng = np.random.default_rng(t * 7919 + b)
    packed = np.zeros((b, t + 3), np.int32)
    lengths = rng.integers(max(1, t - 3), t + 1, b)
    packed[:, :t] = rng.integers(0, 1000, (b, t)) * (np.arange(t)[None, :] < lengths[:, None])
    packed[:, -3], packed[:, -2], packed[:, -1] = lengths, runner.hidden_size, 1
    fn, dev = runner.step_fn(attention), jax.device_put(packed)
    out = fn(runner.state, dev)
    out.block_until_ready()
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(runner.state, dev)
    out.block_until_ready()
    return (time.perf_counter() - t0) / reps * 1e3, np.asarray(out)


def profile(llm, texts: list[str], reps: int) -> dict:
    """Where the timed run's time goes: the device time of its plan's steps run bare
    (each shape `reps` times), the host's tokenizing rate alone (serial, on up to
    100,000 of the texts), the plan's padding, and the jnp attention against the
    runner's on the commonest shape."""
    from jaxllm.pooling.offline import CHUNK
    from jaxllm.pooling.params import PoolingParams
    runner = llm.llm_engine.runner
    lengths = token_counts(llm, texts)
    plan = runner.plan(lengths)
    counts = collections.Counter((t, b) for _, t, b in plan)
    ms = {shape: step_ms(runner, *shape, reps)[0] for shape in counts}
    device_s = sum(ms[s] * c for s, c in counts.items()) / 1e3
    sample = texts[:100000]
    t0 = time.perf_counter()
    for s in range(0, len(sample), CHUNK):
        llm.llm_engine.tokenize(sample[s:s + CHUNK], PoolingParams())
    tok_rate = len(sample) / (time.perf_counter() - t0)
    (t, b), _ = counts.most_common(1)[0]
    info = {"steps": len(plan), "padded_fraction": round(1 - float(lengths.sum()) / sum(
                t_ * b_ for _, t_, b_ in plan), 4),
            "device_only_s": round(device_s, 2),
            "device_only_texts_per_s": round(len(texts) / device_s, 1),
            "tokenize_only_texts_per_s": round(tok_rate, 1), "attention": runner.attention,
            "step_ms": {f"{t_}x{b_}": round(v, 2) for (t_, b_), v in sorted(ms.items())}}
    if runner.attention != "xla":
        mine, a = step_ms(runner, t, b, reps)
        jnp_ms, x = step_ms(runner, t, b, reps, "xla")
        cos = (a * x).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(x, axis=1)
        info.update(common_shape=f"{t}x{b}", common_shape_ms=round(mine, 2),
                    common_shape_xla_attention_ms=round(jnp_ms, 2),
                    attention_vs_xla_cosine_min=round(float(cos.min()), 5))
    return info


def bench_jaxllm(folder: str, dtype: str, texts: list[str], warm: list[str], args):
    import jax
    from jaxllm import LLM, compilation_cache
    compilation_cache.enable(args.compilation_cache_dir)
    flags = dict(runner="pooling", dtype=dtype, max_model_len=512,
                 max_num_seqs=args.max_num_seqs, compilation_cache_dir=args.compilation_cache_dir)
    if args.max_num_batched_tokens:
        flags["max_num_batched_tokens"] = args.max_num_batched_tokens
    t0 = time.perf_counter()
    llm = LLM(folder, **flags)
    load_s = time.perf_counter() - t0
    log(f"jaxllm loaded in {load_s:.1f} s")
    extra = ()
    if args.profile and llm.llm_engine.runner.attention != "xla":
        extra = ((*common_shape(llm, texts), "xla"),)
    shapes, compile_s = precompile(llm, [warm, texts], extra)
    log(f"jaxllm: {shapes} step shapes compiled in {compile_s:.1f} s")
    t0 = time.perf_counter()
    llm.embed(warm, use_tqdm=False)
    warm_s = time.perf_counter() - t0
    log(f"jaxllm warm-up ({len(warm):,} texts) {warm_s:.1f} s")
    t0 = time.perf_counter()
    outs = llm.embed(texts, use_tqdm=False)
    seconds = time.perf_counter() - t0
    log(f"jaxllm: {len(texts):,} texts in {seconds:.1f} s")
    check = np.stack([o.outputs.data for o in outs[:args.check]])
    del outs
    runner = llm.llm_engine.runner
    info = {"attention": runner.attention, "load_s": round(load_s, 1),
            "compile_s": round(compile_s, 1), "step_shapes": shapes,
            "warm_up_s": round(warm_s, 1), "budget_tokens": runner.budget,
            "max_rows": runner.max_rows, "device": str(jax.devices()[0].device_kind),
            "jax": jax.__version__, "cache": compilation_cache.summary()}
    return seconds, check, info, llm


def run_model(name: str, args, rows: list[dict]) -> dict:
    root = tempfile.mkdtemp(prefix="bench_embed_")
    t0 = time.perf_counter()
    folder, words = build_folder(name, args.dtype, root)
    build_s = time.perf_counter() - t0
    log(f"{name}: folder built in {build_s:.1f} s")
    texts = make_texts(args.num, args.seed, words)
    warm = make_texts(args.warm_up, args.seed + 1, words)
    st_num = min(args.st_num or args.num, args.num)
    row = {"model": name, "num": args.num, "dtype": args.dtype, "seed": args.seed,
           "build_s": round(build_s, 1), "mean_words": float(np.mean([t.count(" ") + 1
                                                                   for t in texts[:10000]]))}
    rows.append(row)
    log(f"{args.num:,} texts made")
    st_vectors = None
    if not args.skip_st:
        st_s, st_vectors, device = bench_st(folder, args.dtype, texts[:st_num],
                                            warm[:2000], args.st_batch_size)
        row.update(st_num=st_num, st_batch_size=args.st_batch_size, st_device=device,
                   st_s=round(st_s, 2), st_texts_per_s=round(st_num / st_s, 1))
        save(rows)
    jx_s, jx_check, info, llm = bench_jaxllm(folder, args.dtype, texts, warm, args)
    row.update(jaxllm_s=round(jx_s, 2), jaxllm_texts_per_s=round(args.num / jx_s, 1), **info)
    save(rows)
    if args.profile:
        t0 = time.perf_counter()
        row["profile"] = prof = profile(llm, texts, args.profile)
        log(f"jaxllm profile ({time.perf_counter() - t0:.1f} s): {json.dumps(prof)}")
    del llm
    if st_vectors is not None:
        row["ratio"] = round(row["jaxllm_texts_per_s"] / row["st_texts_per_s"], 2)
        k = min(len(jx_check), len(st_vectors))
        a, b = jx_check[:k], st_vectors[:k]
        cos = (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)
        row.update(cosine_min=round(float(cos.min()), 5), cosine_mean=round(float(cos.mean()), 6))
    save(rows)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="all",
                   help=f"{', '.join(MODELS)} (or qwen3, bge), comma-separated, or all")
    p.add_argument("--num", type=int, default=1_000_000, help="texts timed (default 1,000,000)")
    p.add_argument("--st-num", type=int, default=None,
                   help="texts for sentence-transformers (a prefix; default: --num)")
    p.add_argument("--st-batch-size", type=int, default=32)
    p.add_argument("--skip-st", action="store_true", help="jaxllm only")
    p.add_argument("--warm-up", type=int, default=30000, help="warm-up texts (other seed)")
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="jaxllm's step budget (default: the engine's, 32768 on a GPU)")
    p.add_argument("--max-num-seqs", type=int, default=4096, help="jaxllm's rows per step cap")
    p.add_argument("--compilation-cache-dir", default=None,
                   help="persistent XLA cache (default: a temp folder); a second run with "
                        "the same folder skips the compiles")
    p.add_argument("--check", type=int, default=2000, help="texts compared between the two")
    p.add_argument("--profile", type=int, default=0, metavar="REPS",
                   help="after the timed run, time each of its step shapes bare REPS times "
                        "(device-only seconds), the tokenizer alone, and the jnp attention "
                        "on the commonest shape")
    args = p.parse_args()
    names = list(MODELS) if args.model == "all" else [
        ALIASES.get(m, m) for m in args.model.split(",")]
    bad = [m for m in names if m not in MODELS]
    if bad:
        p.error(f"--model {bad[0]!r}: choose from {', '.join(MODELS)}")
    if args.compilation_cache_dir is None:
        args.compilation_cache_dir = tempfile.mkdtemp(prefix="bench_embed_xla_")
    rows: list[dict] = []
    for name in names:
        row = run_model(name, args, rows)
        print(json.dumps(row), flush=True)
    for r in rows:
        st = (f"sentence-transformers {r['st_texts_per_s']:,.0f} texts/s ({r['st_num']:,} on "
              f"{r['st_device']}), ratio {r['ratio']}x, cosine min {r['cosine_min']}"
              if "ratio" in r else "sentence-transformers skipped")
        print(f"{r['model']}: jaxllm {r['jaxllm_texts_per_s']:,.0f} texts/s ({r['num']:,} "
              f"texts, {r['device']}, {r['dtype']}); {st}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
