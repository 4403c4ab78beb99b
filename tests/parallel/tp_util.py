"""Helpers of the parallel tests: tiny HF models shaped for tensor parallelism (8
query heads, so TP = 2, 4, 8 all split them; fewer KV heads, so the larger TPs
replicate KV heads), and child processes with several CPU devices."""
from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(TESTS)


def _shared_conftest():
    """tests/conftest.py's model builders (imported by path: 'conftest' is ambiguous)."""
    spec = importlib.util.spec_from_file_location("_tests_conftest",
                                                  os.path.join(TESTS, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# arch -> (HF config overrides, vocab); one layer keeps the compiles short. Llama: 2 KV
# heads (split at TP=2, replicated at 4 and 8), vocab 320 (split). Qwen3: 4 KV heads
# (replicated only at 8), the odd vocab 311, which no TP divides, so embeddings and
# lm_head stay whole.
TP_MODELS = {
    "llama": (dict(num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   num_hidden_layers=1), 320),
    "qwen3": (dict(num_attention_heads=8, num_key_value_heads=4, head_dim=16,
                   num_hidden_layers=1), 311),
}


def make_tp_model(folder: str, arch: str, seed: int = 0) -> str:
    import torch
    import transformers as tf
    overrides, vocab = TP_MODELS[arch]
    shared = _shared_conftest()
    cfg = shared.make_hf_config(arch, vocab_size=vocab, **overrides)
    if getattr(cfg, "layer_types", None):           # Qwen3 lists one entry per layer
        cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():   # large weights, so logits are far apart and greedy is a real test
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.8, 1.2)
    model.save_pretrained(folder)
    shared.build_tokenizer(folder, vocab)
    return folder


def host_devices_env(count: int) -> dict:
    """Environment for a child process with `count` CPU devices (set before it imports
    jax: this process has already initialized its one device)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"--xla_force_host_platform_device_count={count}")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))
    return env


def run_child(args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, env=env, timeout=timeout,
                          capture_output=True, text=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Engine settings of the TP tests: small pools and buckets; a 15-token prefill (one
# 16-token step) then decodes, so two step shapes compile.
ENGINE = dict(dtype="float32", max_model_len=128, max_num_seqs=4, max_num_batched_tokens=16,
              enforce_eager=True, num_gpu_blocks_override=64)
PROMPTS = [{"prompt_token_ids": ids}
           for ids in ([5, 9, 2], [17, 3, 8, 11, 40, 2, 7], [1, 2, 3, 4, 5])]


def generate_greedy(llm, max_tokens: int = 4):
    """(token ids per prompt, the gathered [S, V] logits the sampler saw per step)."""
    import numpy as np
    from jaxllm.sampling_params import SamplingParams
    runner, seen = llm.llm_engine.runner, []
    sample = runner._sample

    def capture(logits, md, flags, token_buf):
        assert logits.sharding.is_fully_replicated, logits.sharding
        seen.append(np.asarray(logits))
        return sample(logits, md, flags, token_buf)

    runner._sample = capture
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    try:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    finally:
        runner._sample = sample
    return [list(o.outputs[0].token_ids) for o in outs], seen
