"""What the pooling runner hands back, in vLLM's shapes.

vLLM's PoolingOutput holds a tensor (``data``) and EmbeddingOutput a list of floats
(``embedding``). Here ``data`` is a float32 numpy row and ``embedding`` its list,
built when read: a million 1,024-dim vectors as Python floats would take minutes
and tens of GB, and most batch users read ``data`` or stack the rows anyway.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


@dataclass
class PoolingOutput:
    data: np.ndarray            # float32 [E]

    def __repr__(self) -> str:
        return f"PoolingOutput(data=<{self.data.shape[0]} floats>)"


@dataclass
class EmbeddingOutput:
    data: np.ndarray            # float32 [E]

    @property
    def embedding(self) -> list[float]:
        return self.data.tolist()

    @property
    def hidden_size(self) -> int:
        return int(self.data.shape[0])

    def __repr__(self) -> str:
        return f"EmbeddingOutput(hidden_size={self.hidden_size})"


@dataclass
class PoolingRequestOutput:
    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None


@dataclass
class EmbeddingRequestOutput:
    """One input's vector: ``out.outputs.embedding`` (vLLM's EmbeddingRequestOutput)."""
    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True
    prompt: str | None = None

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> "EmbeddingRequestOutput":
        return cls(out.request_id, EmbeddingOutput(out.outputs.data), out.prompt_token_ids,
                   out.finished, out.prompt)
