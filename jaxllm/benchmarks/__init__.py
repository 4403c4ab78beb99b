"""`jaxllm bench latency | throughput | serve`: vLLM's benchmark commands, with their
flag names and printed fields. Each module has `add_arguments(parser)`,
`check_arguments(args)` and `run(...)`."""
