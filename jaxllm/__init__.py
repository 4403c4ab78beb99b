"""jaxllm: vLLM's engine ideas on JAX/XLA for NVIDIA GPUs."""
__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "__version__"]


def __getattr__(name):
    # Lazy, so that `import jaxllm.engine.scheduler` does not pull in jax.
    if name == "LLM":
        from jaxllm.entrypoints.llm import LLM
        return LLM
    if name == "SamplingParams":
        from jaxllm.sampling_params import SamplingParams
        return SamplingParams
    if name in ("RequestOutput", "CompletionOutput"):
        from jaxllm import outputs
        return getattr(outputs, name)
    raise AttributeError(name)
