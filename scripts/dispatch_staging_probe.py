"""Host time per model step + sampler launch against which of the step's buffers
change address from one step to the next: the packed inputs (a new transfer each
step, or copied into one persistent donated buffer) and the sampled-token buffer
(a new one from the sampler, or the same one donated back).

A 32-layer model with tiny dims (the 8B step's buffer and kernel count, negligible
device time), as scripts/step_dispatch.py. GPU only.

    python scripts/dispatch_staging_probe.py [configs/models/llama-3.1-8b]
"""
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


def main():
    src = sys.argv[1] if len(sys.argv) > 1 else "configs/models/llama-3.1-8b"
    folder = tempfile.mkdtemp()
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), folder)
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=256, intermediate_size=512, num_attention_heads=4,
               num_key_value_heads=2, head_dim=64, vocab_size=1024)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    import jax
    import jax.numpy as jnp
    import step_profile
    from jaxllm import LLM
    from jaxllm.runner.step_inputs import StepInputs
    llm = LLM(folder, load_format="dummy", dtype="bfloat16", max_model_len=2048,
              max_num_seqs=256, max_num_batched_tokens=8192, enforce_eager=True,
              num_gpu_blocks_override=2048)
    r = llm.llm_engine.runner
    arrays, dec = step_profile.step_arrays(r, 8, 100)
    first = StepInputs.pack(arrays, dec, r._replicated)
    packed_host = jax.device_get(first.packed)

    def sample(logits, buf):
        ids = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return jax.lax.dynamic_update_slice(buf, ids, (0,))
    sample_new = jax.jit(sample)
    sample_donated = jax.jit(sample, donate_argnums=1)
    stage = jax.jit(lambda buf, new: jax.lax.dynamic_update_slice(buf, new, (0,)),
                    donate_argnums=0)
    n = int(os.environ.get("N", "300"))
    results = {}
    for inputs_mode in ("new", "staged", "same"):
        for donate in (False, True):
            staged = StepInputs(jnp.array(packed_host), first.num_tokens, first.num_seqs,
                                first.width, first.decode_only)
            tb = jnp.zeros_like(r._token_buf)
            samp = sample_donated if donate else sample_new

            def one(staged, tb):
                if inputs_mode == "new":
                    inputs = StepInputs.pack(arrays, dec, r._replicated)
                elif inputs_mode == "staged":
                    inputs = StepInputs(stage(staged.packed,
                                              jax.device_put(packed_host, r._replicated)),
                                        first.num_tokens, first.num_seqs, first.width,
                                        first.decode_only)
                else:
                    inputs = staged
                logits, r.kv_caches = r._step(r._leaves, r.kv_caches, tb, inputs)
                return inputs, samp(logits, tb)
            for _ in range(5):
                staged, tb = one(staged, tb)
            jax.block_until_ready(tb)
            t0 = time.perf_counter()
            for _ in range(n):
                staged, tb = one(staged, tb)
            t1 = time.perf_counter()
            jax.block_until_ready(tb)
            t2 = time.perf_counter()
            key = f"inputs {inputs_mode}, token buffer {'donated' if donate else 'new'}"
            results[key] = {"launch_us": round((t1 - t0) / n * 1e6, 1),
                            "with_device_us": round((t2 - t0) / n * 1e6, 1)}
            print(key, results[key], flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
