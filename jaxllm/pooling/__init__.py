"""The pooling runner (vLLM's ``--runner pooling``): embeddings from encoder (BERT
family) and decoder (Qwen3-Embedding style) models, prefill only, no KV cache.

    from jaxllm import LLM
    llm = LLM("BAAI/bge-base-en-v1.5-folder", runner="pooling")
    vectors = [o.outputs.embedding for o in llm.embed(["hello", "world"])]
"""
from jaxllm.pooling.outputs import (EmbeddingOutput, EmbeddingRequestOutput, PoolingOutput,
                                    PoolingRequestOutput)
from jaxllm.pooling.params import PoolingParams

__all__ = ["EmbeddingOutput", "EmbeddingRequestOutput", "PoolingOutput",
           "PoolingRequestOutput", "PoolingParams"]
