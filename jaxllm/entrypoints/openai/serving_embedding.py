"""/v1/embeddings: OpenAI's request and response (vLLM's extras: truncate_prompt_tokens,
normalize), over the pooling runner's async engine (jaxllm/pooling/server.py).

``input`` is a string, a list of strings, a list of token ids or a list of those;
``encoding_format`` float (lists) or base64 (little-endian float32 bytes, what the
openai SDK asks for by default); ``dimensions`` only for Matryoshka models.
"""
from __future__ import annotations

import base64
import time
import uuid
from typing import Literal

import numpy as np
from starlette.responses import JSONResponse

from jaxllm.entrypoints.openai.errors import bad_request
from jaxllm.entrypoints.openai.protocol import OpenAIBaseModel
from jaxllm.pooling.engine import InputError
from jaxllm.pooling.params import PoolingParams


class EmbeddingRequest(OpenAIBaseModel):
    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    # vLLM's extras
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None

    def check_supported(self) -> None:
        if self.input == []:
            raise bad_request("'input' must not be empty.", param="input")

    def prompts(self) -> list:
        inp = self.input
        if isinstance(inp, str) or (inp and isinstance(inp[0], int)):
            return [inp]
        return list(inp)

    def pooling_params(self) -> PoolingParams:
        try:
            return PoolingParams(truncate_prompt_tokens=self.truncate_prompt_tokens,
                                 dimensions=self.dimensions, normalize=self.normalize)
        except ValueError as e:
            message = str(e).removeprefix("PoolingParams.")
            raise bad_request(message, param=message.split("=", 1)[0]) from None


class OpenAIServingEmbedding:
    def __init__(self, engine, models):
        self.engine = engine        # AsyncPoolingEngine
        self.models = models

    async def create(self, req: EmbeddingRequest) -> JSONResponse:
        self.models.check(req.model)
        params = req.pooling_params()
        try:
            vectors, ids = await self.engine.embed(req.prompts(), params)
        except InputError as e:
            raise bad_request(str(e), param=e.param) from None
        data = [{"index": i, "object": "embedding", "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        tokens = sum(len(t) for t in ids)
        return JSONResponse({
            "id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
            "model": self.models.model_name, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})


def _encode(vector: np.ndarray, encoding_format: str):
    if encoding_format == "base64":
        return base64.b64encode(vector.astype("<f4").tobytes()).decode()
    return vector.tolist()
