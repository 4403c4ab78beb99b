"""`jaxllm embed MODEL --input FILE --output FILE`: embed every line of a file.

In: text lines (line i is text i, blank lines included so rows stay aligned), or a
.jsonl file with a string, {"text": ...}, {"input": ...} or {"prompt_token_ids": [...]}
a line. Out: .npy (float32 [lines, E], written in place as it goes) or .jsonl
({"index": i, "embedding": [...]} a line). A run that stops part-way resumes where it
ended: for .jsonl, after the complete lines already in the output; for .npy, after
the row count in OUTPUT.progress, which is written once each chunk is on disk.
"""
from __future__ import annotations

import json
import os
import sys

from jaxllm.config import ConfigError


def add_embed_parser(sub, add_engine_args, launch_config) -> None:
    """`jaxllm embed`'s parser; `launch_config` is the CLI's (settings merged and
    checked), passed in so this module does not import the CLI back."""
    p = sub.add_parser("embed", help="embed the lines of a file (.npy or JSON lines out)",
                       allow_abbrev=False)
    add_engine_args(p)
    p.add_argument("--input", required=True, metavar="FILE",
                   help="text lines, or .jsonl: a string, {\"text\": ...} or "
                        "{\"prompt_token_ids\": [...]} a line")
    p.add_argument("--output", required=True, metavar="FILE", help=".npy or .jsonl")
    p.add_argument("--truncate-prompt-tokens", type=int, default=None, metavar="N",
                   help="keep the last N tokens of longer inputs (-1: the model's maximum); "
                        "default: a longer input is an error")
    p.add_argument("--dimensions", type=int, default=None, metavar="D",
                   help="keep the first D dimensions (Matryoshka models only)")
    p.add_argument("--chunk-size", type=int, default=32768, metavar="LINES",
                   help="lines per chunk (each chunk is written before the next)")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_embed, launch_config=launch_config)


def pooling_launch(config, command: str):
    """None for a generative model; for the pooling runner, the checks of its launch
    (no jax) and the model's pooling facts (a PoolingModelInfo)."""
    from jaxllm import compilation_cache
    from jaxllm.pooling.model_info import read_pooling_info, resolve_runner
    if resolve_runner(config.model) != "pooling":
        return None
    if command not in ("serve", "embed"):
        raise ConfigError(f"runner=pooling: {config.model.model} is an embedding model; "
                          f"`jaxllm {command}` generates text. Use `jaxllm embed` or "
                          "`jaxllm serve` (/v1/embeddings)")
    info = read_pooling_info(config.model.model)
    max_len = config.model.max_model_len
    if max_len is not None and max_len > info.context_len:
        raise ConfigError(f"max_model_len={max_len} exceeds the model's {info.context_len} "
                          f"tokens ({config.model.model}); set it to {info.context_len} or less")
    compilation_cache.enable(config.compilation_cache_dir)
    return info


def cmd_embed(args) -> int:
    from jaxllm import compilation_cache
    from jaxllm.pooling.params import PoolingParams
    if args.chunk_size < 1:
        raise ConfigError(f"chunk_size={args.chunk_size}: must be >= 1")
    if not args.output.endswith((".npy", ".jsonl")):
        raise ConfigError(f"output={args.output!r}: name a .npy or .jsonl file")
    try:
        params = PoolingParams(truncate_prompt_tokens=args.truncate_prompt_tokens,
                               dimensions=args.dimensions)
    except ValueError as e:
        raise ConfigError(str(e).removeprefix("PoolingParams.")) from None
    prompts = read_inputs(args.input)
    if not hasattr(args, "runner"):      # this command only embeds
        args.runner = "pooling"
    config, _ = args.launch_config(args)
    from jaxllm.pooling.engine import InputError, PoolingEngine
    engine = PoolingEngine(config)
    try:
        engine.check_params(params)
    except InputError as e:
        raise ConfigError(str(e)) from None
    dims = params.dimensions or engine.info.hidden_size
    writer = NpyWriter(args.output, len(prompts), dims) if args.output.endswith(".npy") \
        else JsonlWriter(args.output)
    done = writer.done
    if done > len(prompts):
        raise ConfigError(f"output={args.output!r} has {done} rows but the input has "
                          f"{len(prompts)} lines; is it another run's output?")
    from jaxllm.pooling.offline import _progress, embed_chunks
    try:
        with _progress(not args.disable_tqdm, len(prompts), "Embedded lines", done) as bar:
            for start, _, vectors in embed_chunks(engine, prompts[done:], params, bar,
                                                  args.chunk_size, "line", done + 1):
                writer.write(done + start, vectors[:, :dims])
    except InputError as e:
        raise ConfigError(f"{args.input}: {e}") from None
    finally:
        writer.close()
    print(f"jaxllm embed: {len(prompts)} vectors of {dims} in {args.output}"
          + (f" ({done} from an earlier run)" if done else ""), file=sys.stderr)
    cache = compilation_cache.summary()
    if cache:
        print(f"jaxllm: {cache}", file=sys.stderr)
    return 0


def read_inputs(path: str) -> list:
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except OSError as e:
        raise ConfigError(f"input={path!r}: cannot read it ({e.strerror})") from None
    if lines and lines[-1] == "":
        lines.pop()      # the final newline ends the last line, it starts none
    if not path.endswith(".jsonl"):
        return lines
    return [_json_input(line, path, n) for n, line in enumerate(lines, 1)]


def _json_input(line: str, path: str, lineno: int):
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and len(item) == 1:
        key, value = next(iter(item.items()))
        if key in ("text", "input") and isinstance(value, str):
            return value
        if key == "prompt_token_ids" and isinstance(value, list):
            return item
    raise ConfigError(f"{path}:{lineno}: give a string, {{\"text\": \"...\"}} or "
                      "{\"prompt_token_ids\": [...]} on each line")


class JsonlWriter:
    def __init__(self, path: str):
        self.path = path
        self.done = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                data = f.read()
            complete = data[:data.rfind(b"\n") + 1]     # a torn last line is redone
            self.done = complete.count(b"\n")
            with open(path, "wb") as f:
                f.write(complete)
        self.f = open(path, "a", encoding="utf-8")

    def write(self, start: int, vectors) -> None:
        self.f.write("".join(json.dumps({"index": start + i, "embedding": v.tolist()}) + "\n"
                             for i, v in enumerate(vectors)))
        self.f.flush()

    def close(self) -> None:
        self.f.close()


class NpyWriter:
    """A float32 [rows, dims] .npy filled in place. OUTPUT.progress holds the rows
    done while a run is under way and goes once all are; a .npy of the right shape
    without it is a finished run."""

    def __init__(self, path: str, rows: int, dims: int):
        import numpy as np
        self.progress, self.rows = path + ".progress", rows
        if os.path.exists(path):
            self.array = np.lib.format.open_memmap(path, mode="r+")
            if self.array.shape != (rows, dims) or self.array.dtype != np.float32:
                raise ConfigError(f"output={path!r} holds {self.array.dtype} "
                                  f"{self.array.shape}, not float32 ({rows}, {dims}); "
                                  "remove it or name another output")
            self.done = rows
            if os.path.exists(self.progress):
                with open(self.progress) as f:
                    self.done = int(f.read().strip() or 0)
        else:
            self.array = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32,
                                                   shape=(rows, dims))
            self.done = 0
            self._mark(0)

    def write(self, start: int, vectors) -> None:
        self.array[start:start + len(vectors)] = vectors
        self.array.flush()
        self._mark(start + len(vectors))

    def _mark(self, rows: int) -> None:
        tmp = self.progress + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(rows))
        os.replace(tmp, self.progress)

    def close(self) -> None:
        self.array.flush()
        del self.array
        if os.path.exists(self.progress) and self._done_rows() >= self.rows:
            os.remove(self.progress)

    def _done_rows(self) -> int:
        with open(self.progress) as f:
            return int(f.read().strip() or 0)
