"""`jaxllm serve | generate | chat | bench`: launches from flags and config files.

Engine flags are the flat keys of `jaxllm.config` with vLLM's names; a `--config`
file sets the same keys, flags override it. Everything that can be checked before
the weights load is checked first; a bad setting is one line on stderr and exit
code 2. jax is imported only after the flags parse, so `--help` is quick.
"""
from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import logging
import sys
import time

from jaxllm.compilation_cache import DEFAULT_DIR
from jaxllm.config import FLAT_KEYS, SECTIONS, ConfigError, EngineConfig, flat_from_config
from jaxllm.entrypoints.cli_help import ENGINE_HELP
from jaxllm.pooling.embed_cli import add_embed_parser, pooling_launch

SERVER_KEYS = {f.name for f in dataclasses.fields(SECTIONS["server"])}
# The launcher's own defaults, below the config file: the compile cache is on, and a
# CPU `serve` answers before every bucket is compiled (one-shot commands exit soon
# after their first requests: they compile what they use).
LAUNCH_DEFAULTS = {"compilation_cache_dir": DEFAULT_DIR}
SERVE_DEFAULTS = {**LAUNCH_DEFAULTS, "compile_in_background": True}

SAMPLING_FLAGS = {  # name -> (type, default, help)
    "max_tokens": (int, 256, "most tokens to generate per completion"),
    "temperature": (float, 1.0, "sampling temperature; 0 = greedy"),
    "top_p": (float, 1.0, "keep the most likely tokens up to this total probability"),
    "top_k": (int, 0, "keep the k most likely tokens; 0 = all"),
    "min_p": (float, 0.0, "drop tokens below this fraction of the top token's probability"),
    "n": (int, 1, "completions per prompt"),
    "presence_penalty": (float, 0.0, "penalize tokens that already appeared"),
    "frequency_penalty": (float, 0.0, "penalize tokens by how often they appeared"),
    "repetition_penalty": (float, 1.0, "divide logits of seen tokens by this (1 = off)"),
}


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        fail(f"{self.prog}: error: {message} (see {self.prog} --help)")


def fail(line: str):
    print(line, file=sys.stderr)
    sys.exit(2)


# ---------------------------------------------------------------- parser

def add_engine_args(p: argparse.ArgumentParser, server: bool = False) -> None:
    p.add_argument("model_path", nargs="?", metavar="MODEL", default=None,
                   help="same as --model")
    p.add_argument("--config", metavar="FILE",
                   help="YAML or TOML file of these settings (keys with _ or -); flags win")
    defaults = flat_from_config(EngineConfig())
    for section in (*SECTIONS, None):
        title = f"{section} settings" if section else "engine settings"
        group = p.add_argument_group(title)
        for key, (sec, _) in FLAT_KEYS.items():
            if sec != section or (key in SERVER_KEYS and not server):
                continue
            flag = "--" + key.replace("_", "-")
            default = (SERVE_DEFAULTS if server else LAUNCH_DEFAULTS).get(key, defaults[key])
            help_ = ENGINE_HELP.get(key, "see jaxllm/config.py")
            if "default:" not in help_:
                help_ += f" (default: {_show(default)})"
            if isinstance(default, bool):
                group.add_argument(flag, dest=key, action=argparse.BooleanOptionalAction,
                                   default=argparse.SUPPRESS, help=help_)
            else:
                group.add_argument(flag, dest=key, default=argparse.SUPPRESS,
                                   nargs="+" if isinstance(default, tuple) else None,
                                   metavar=key.split("_")[-1].upper(), help=help_)


def _show(default) -> str:
    if isinstance(default, tuple):
        return ", ".join(default) or "none"
    return "none" if default is None else str(default)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    group = p.add_argument_group("sampling")
    for name, (type_, default, help_) in SAMPLING_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=type_, default=default,
                           help=f"{help_} (default: {default})")
    group.add_argument("--stop", action="append", default=[], metavar="TEXT",
                       help="stop at this string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true",
                       help="keep generating past the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    from jaxllm.benchmarks import latency, serve as bench_serve, throughput
    parser = _Parser(prog="jaxllm", allow_abbrev=False,
                     description="Serve and run LLMs with JAX (vLLM's flags and API).")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)
    add_engine_args(p, server=True)
    p.set_defaults(func=cmd_serve)
    add_embed_parser(sub, add_engine_args, launch_config)

    p = sub.add_parser("generate", help="complete prompts, JSON lines out", allow_abbrev=False)
    add_engine_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    p.add_argument("--prompts-file", metavar="FILE",
                   help="one prompt a line; a .jsonl file: a string, {\"prompt\": ...} or "
                        "{\"prompt_token_ids\": [...]} a line; - = stdin")
    p.add_argument("--output", metavar="FILE", help="write the JSON lines here, not stdout")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    add_sampling_args(p)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat on stdin (/exit or EOF ends)",
                       allow_abbrev=False)
    add_engine_args(p)
    p.add_argument("--system", metavar="TEXT", help="system prompt")
    add_sampling_args(p)
    p.set_defaults(func=cmd_chat)

    bench = sub.add_parser("bench", help="benchmarks: latency, throughput, serve",
                           allow_abbrev=False)
    bench_sub = bench.add_subparsers(dest="bench", required=True, parser_class=_Parser)
    for name, module, desc in (
            ("latency", latency, "end-to-end latency of one batch"),
            ("throughput", throughput, "offline throughput of many requests at once"),
            ("serve", bench_serve, "online latency against a running server")):
        p = bench_sub.add_parser(name, help=desc, description=desc, allow_abbrev=False)
        uses_engine = module is not bench_serve    # bench serve is a client
        if uses_engine:
            add_engine_args(p)
        module.add_arguments(p)
        p.set_defaults(func=cmd_bench, bench_module=module, uses_engine=uses_engine)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:
        sub = _subparser(parser, args)
        unknown = next((a for a in extra if a.startswith("-")), extra[0]).split("=")[0]
        options = [o for a in sub._actions for o in a.option_strings]
        close = difflib.get_close_matches(unknown, options, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        fail(f"{sub.prog}: error: unknown argument {unknown!r}{hint} "
             f"(see {sub.prog} --help)")
    return args


def _subparser(parser, args):
    """The (sub)parser that the command line chose, for error messages."""
    for name in (args.command, getattr(args, "bench", None)):
        action = next((a for a in parser._actions
                       if isinstance(a, argparse._SubParsersAction)), None)
        if action is None or name is None:
            break
        parser = action.choices[name]
    return parser


# ---------------------------------------------------------------- launching

def launch_config(args, engine_process: bool = False):
    """(EngineConfig, ArchConfig): the settings merged and checked, weights not read.

    engine_process: `serve`, whose engine runs in a process of its own that prepares
    the launch itself (jax.distributed, the devices). Here only the checks that need
    no jax run, so the server process never starts a backend (on a GPU it would take
    the engine's memory; multi-host, it would hold the coordinator)."""
    from jaxllm import config_file
    flags = {k: v for k, v in vars(args).items() if k in FLAT_KEYS}
    if args.model_path is not None:
        if flags.get("model", args.model_path) != args.model_path:
            raise ConfigError(f"model given twice ({args.model_path!r} and --model "
                              f"{flags['model']!r}); keep one")
        flags["model"] = args.model_path
    config = config_file.build_config(args.config, flags, SERVE_DEFAULTS
                                      if args.command == "serve" else LAUNCH_DEFAULTS)
    pooling = pooling_launch(config, args.command)     # a PoolingModelInfo, or None
    if pooling is not None:
        return config, pooling
    if engine_process and config.parallel.process_id == 0 \
            and not config.server.disable_frontend_multiprocessing:
        return config, config_file.check_model(config)
    arch = config_file.prepare_launch(config)
    if config.parallel.process_id != 0:
        # Multi-host: processes other than 0 only follow the steps process 0 sends.
        from jaxllm.executor.executor import run_follower
        run_follower(config)
        raise SystemExit(0)
    return config, arch


def make_llm(config: EngineConfig):
    from jaxllm.entrypoints.llm import LLM
    return LLM(**flat_from_config(config))


def sampling_params(args, **overrides):
    from jaxllm.sampling_params import SamplingParams
    fields = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    fields.update(stop=args.stop or None, ignore_eos=args.ignore_eos, **overrides)
    try:
        return SamplingParams(**fields)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def report_cache() -> None:
    from jaxllm import compilation_cache
    line = compilation_cache.summary()
    if line:
        print(f"jaxllm: {line}", file=sys.stderr)


def cmd_serve(args) -> int:
    config, arch = launch_config(args, engine_process=True)
    if hasattr(arch, "pooling_type"):     # the pooling runner: no engine process
        from jaxllm.pooling.server import run_pooling_server
        return run_pooling_server(config)
    spawned = None
    if not config.server.disable_frontend_multiprocessing:
        # The engine process loads while this one imports the server (a second or so).
        from jaxllm.engine.core_client import spawn_engine
        spawned = spawn_engine(config)
    from jaxllm.entrypoints.openai.api_server import run_server
    return run_server(config, spawned=spawned, started=getattr(args, "started", None))


def cmd_generate(args) -> int:
    params = sampling_params(args)
    prompts = read_prompts(args.prompt, args.prompts_file)
    config, _ = launch_config(args)
    llm = make_llm(config)
    outputs = llm.generate(prompts, params, use_tqdm=not args.disable_tqdm)
    out = open(args.output, "w") if args.output else sys.stdout
    try:
        for i, (prompt, result) in enumerate(zip(prompts, outputs)):
            out.write(json.dumps(output_record(i, prompt, result)) + "\n")
    finally:
        if out is not sys.stdout:
            out.close()
    report_cache()
    return 0


def read_prompts(prompts: list[str], path: str | None) -> list:
    """--prompt values, then the file's: text lines, or JSON lines for .jsonl."""
    items = list(prompts)
    if path:
        try:
            f = sys.stdin if path == "-" else open(path)
        except OSError as e:
            raise ConfigError(f"prompts_file={path!r}: cannot read it ({e.strerror})") from None
        with f:
            lines = [line.rstrip("\n") for line in f]
        as_json = path.endswith(".jsonl")
        items += [_json_prompt(line, path, n) if as_json else line
                  for n, line in enumerate(lines, 1) if line.strip()]
    if not items:
        raise ConfigError("no prompts: give --prompt TEXT or --prompts-file FILE")
    return items


def _json_prompt(line: str, path: str, lineno: int):
    try:
        item = json.loads(line)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}:{lineno}: not JSON ({e.msg})") from None
    if isinstance(item, str):
        return item
    if isinstance(item, dict) and len(item) == 1 and (
            isinstance(item.get("prompt"), str) or isinstance(item.get("prompt_token_ids"), list)):
        return item.get("prompt", item)
    raise ConfigError(f"{path}:{lineno}: give a string, {{\"prompt\": \"...\"}} or "
                      "{\"prompt_token_ids\": [...]} on each line")


def output_record(index: int, prompt, result) -> dict:
    return {
        "index": index,
        "prompt": prompt if isinstance(prompt, str) else None,
        "num_prompt_tokens": len(result.prompt_token_ids or []),
        "outputs": [{"text": c.text, "token_ids": list(c.token_ids),
                     "finish_reason": c.finish_reason} for c in result.outputs],
    }


def cmd_chat(args) -> int:
    params = sampling_params(args)
    config, _ = launch_config(args)
    llm = make_llm(config)
    system = [{"role": "system", "content": args.system}] if args.system else []
    messages = list(system)
    interactive = sys.stdin.isatty()
    if interactive:
        print("jaxllm chat: type a message; /reset clears the history, /exit ends.")
    while True:
        if interactive:
            print("> ", end="", flush=True)
        line = sys.stdin.readline()
        text = line.strip()
        if not line or text == "/exit":
            break
        if text == "/reset":
            messages = list(system)
        elif text:
            messages.append({"role": "user", "content": text})
            try:
                reply = llm.chat(messages, params, use_tqdm=False)[0].outputs[0].text
            except ValueError as e:     # e.g. the conversation outgrew max_model_len
                messages.pop()
                print(f"jaxllm chat: {e} (/reset starts over)", file=sys.stderr)
                continue
            messages.append({"role": "assistant", "content": reply})
            print(reply, flush=True)
    report_cache()
    return 0


def cmd_bench(args) -> int:
    module = args.bench_module
    module.check_arguments(args)
    if not args.uses_engine:
        return module.run(args)
    config, arch = launch_config(args)
    llm = make_llm(config)
    code = module.run(args, llm, arch.vocab_size)
    report_cache()
    return code


def main(argv=None) -> int:
    started = time.perf_counter()
    args = parse_args(argv)
    args.started = started      # where `serve`'s start-up timeline begins
    if not logging.getLogger().handlers:      # the engine's start-up lines, on stderr
        logging.basicConfig(level=logging.INFO,
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        if logging.getLogger("jax").level == logging.NOTSET:   # JAX_LOGGING_LEVEL wins
            logging.getLogger("jax").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ConfigError as e:
        command = " ".join(filter(None, (args.command, getattr(args, "bench", None))))
        fail(f"jaxllm {command}: error: {e}")
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
