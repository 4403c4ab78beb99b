"""One line of `--help` per engine key (the CLI appends the default from the config
dataclasses)."""

ENGINE_HELP = {
    "model": "HF model folder (config.json + *.safetensors) or .gguf file; "
             "default: the embedded SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer folder or .gguf file, if not the model's",
    "dtype": "weight and activation dtype; auto = the checkpoint's (float32 for GGUF)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's context",
    "load_format": "auto | safetensors | gguf | dummy (random weights of the model's shape, "
                   "built on the device)",
    "seed": "seed for random weights and for requests that set none",
    "quantization": "fp8 (= ptpc_fp8) | int8: quantize a float model's linear layers at "
                    "load (W8A8, per-channel weights, per-token activations); default: "
                    "the checkpoint's quantization_config (compressed-tensors, fp8, awq "
                    "= awq_marlin, gptq = gptq_marlin)",
    "served_model_name": "name(s) the server answers to; default: the model path",
    "chat_template": "Jinja file overriding the tokenizer's chat template",
    "generation_config": "sampling defaults: auto (model's generation_config.json) | vllm | DIR",
    "runner": "generate | pooling (embeddings); auto: pooling for encoders and bare decoders",
    "block_size": "tokens per KV-cache block: 8, 16 or 32",
    "gpu_memory_utilization": "fraction of GPU memory for weights, activations and KV cache",
    "kv_cache_dtype": "auto (the model dtype; fp8 for a checkpoint storing KV scales), fp8 "
                      "(= fp8_e4m3: twice the KV blocks) or fp8_e5m2",
    "swap_space": "GiB of host memory for KV blocks of preempted requests (preemption swap)",
    "enable_prefix_caching": "reuse the KV blocks of prompt prefixes seen before",
    "cpu_kv_cache_bytes": "KV-pool bytes on CPU, where there is no device memory to profile",
    "num_gpu_blocks_override": "use exactly this many KV blocks instead of sizing from memory",
    "max_num_seqs": "most sequences in one step (the batch-size cap)",
    "max_num_batched_tokens": "token budget of one step; default 8192 on a GPU with >= 70 GiB "
                              "(not an A100), else 2048, as vLLM's server",
    "enable_chunked_prefill": "split long prompts over several steps so decodes keep running",
    "preemption_mode": "when KV blocks run out: recompute, or swap to host memory",
    "async_scheduling": "prepare the next step while the device runs this one",
    "scheduling_policy": "fcfs (arrival order) or priority (request's priority, lower first)",
    "tensor_parallel_size": "shard the model over this many devices (must divide the heads)",
    "coordinator_address": "multi-host: host:port of process 0 for jax.distributed",
    "num_processes": "multi-host: how many processes (one per host)",
    "process_id": "multi-host: this process's index",
    "host": "address to listen on",
    "port": "port to listen on",
    "api_key": "require this key as a Bearer token on /v1 routes",
    "disable_frontend_multiprocessing": "run the engine in a thread of the server process "
                                        "instead of its own process (they then share the GIL)",
    "enable_auto_tool_choice": "let the model call tools on its own (tool_choice auto); "
                               "needs --tool-call-parser",
    "tool_call_parser": "how the model writes tool calls: hermes (Qwen2.5/3), qwen3_xml "
                        "(Qwen3-Coder), llama3_json, mistral, pythonic",
    "reasoning_parser": "split the model's thinking into 'reasoning': qwen3, deepseek_r1",
    "max_waiting_requests": "429 + Retry-After while this many requests wait; default: no bound",
    "attention_backend": "auto (pallas on GPU, reference on CPU) | pallas | reference",
    "compilation_cache_dir": "persistent XLA compilation cache folder; none turns it off",
    "enforce_eager": "skip compiling every bucket at warm-up (quicker start, slower first steps)",
    "speculative_config": "speculative decoding, a JSON object of vLLM's keys: method (ngram | "
                          "draft_model | eagle | eagle3), num_speculative_tokens (1..16), "
                          "prompt_lookup_min/max (ngram), model (draft or EAGLE head folder), "
                          "disable_by_batch_size; e.g. '{\"method\": \"ngram\", "
                          "\"num_speculative_tokens\": 4}'",
    "compile_in_background": "on CPU: compile the buckets first requests need, then serve "
                             "while the rest compile",
}
