"""Host time to dispatch the runner's step: a 32-layer model with tiny dims (same
buffers and kernel count as the 8B shape, negligible device time)."""
import json, os, sys, time, shutil, tempfile
sys.path.insert(0, os.path.join(os.getcwd(), "scripts"))
src = sys.argv[1] if len(sys.argv) > 1 else "configs/models/llama-3.1-8b"
d = tempfile.mkdtemp()
for n in os.listdir(src): shutil.copy(os.path.join(src, n), d)
cfg = json.load(open(os.path.join(d, "config.json")))
cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
           head_dim=64, vocab_size=1024)
json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
import jax
from jaxllm import LLM
import step_profile
llm = LLM(d, load_format="dummy", dtype="bfloat16", max_model_len=2048, max_num_seqs=256,
          max_num_batched_tokens=8192, enforce_eager=True, num_gpu_blocks_override=2048)
r = llm.llm_engine.runner
arrays, dec = step_profile.step_arrays(r, 1, 100)
jax.block_until_ready(r._launch(arrays, dec))
N = int(os.environ.get("N", "300"))
t = time.perf_counter()
for _ in range(N):
    out = r._launch(arrays, dec)
t1 = time.perf_counter(); jax.block_until_ready(out)
t2 = time.perf_counter()
res = {"launch_us": (t1 - t) / N * 1e6, "incl_device_us": (t2 - t) / N * 1e6}
t = time.perf_counter()
for _ in range(N):
    a = r._step_args(arrays, dec)
res["step_args_us"] = (time.perf_counter() - t) / N * 1e6
args = r._step_args(arrays, dec)
for _ in range(3):
    logits, r.kv_caches = r._step(*args[:1], r.kv_caches, *args[2:])
jax.block_until_ready(logits)
t = time.perf_counter()
for _ in range(N):
    logits, r.kv_caches = r._step(args[0], r.kv_caches, *args[2:])
t1 = time.perf_counter(); jax.block_until_ready(logits)
res["step_call_us"] = (t1 - t) / N * 1e6
res["xla_flags"] = os.environ.get("XLA_FLAGS", "")
print(json.dumps(res), flush=True)
