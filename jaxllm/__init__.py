"""jaxllm: vLLM's engine ideas on JAX/XLA for NVIDIA GPUs."""
import logging

__version__ = "0.1.0"


class _NoTorchNotice(logging.Filter):
    """jaxllm never uses torch: transformers' import-time line "PyTorch was not found.
    Models won't be available ..." reads like a broken install, so it is dropped (only
    that line; transformers' other warnings stay)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("PyTorch was not found")


logging.getLogger("transformers").addFilter(_NoTorchNotice())

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
