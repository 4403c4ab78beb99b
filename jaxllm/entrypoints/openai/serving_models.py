"""The served model names (``--served-model-name``, several allowed) and /v1/models."""
from __future__ import annotations

import time

from jaxllm.entrypoints.openai.errors import APIError


class OpenAIServingModels:
    def __init__(self, names: tuple[str, ...], root: str, max_model_len: int):
        if not names:
            raise ValueError("at least one served model name is needed")
        self.names = names
        self.root = root
        self.max_model_len = max_model_len
        self.created = int(time.time())

    @property
    def model_name(self) -> str:
        """The name responses carry: the first served name, as in vLLM."""
        return self.names[0]

    def check(self, model: str | None) -> None:
        """404 unless ``model`` is one of ours (or omitted)."""
        if model is not None and model not in self.names:
            raise APIError(404, f"The model `{model}` does not exist.", param="model",
                           code="model_not_found")

    def list_models(self) -> dict:
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": self.created, "owned_by": "jaxllm",
             "root": self.root, "parent": None, "max_model_len": self.max_model_len}
            for name in self.names]}
