"""/v1/embeddings on a server of a generative model (--runner generate): a 400 that
names the problem, as vLLM's 'does not support Embeddings API'."""
from __future__ import annotations

import openai
import pytest


def test_embeddings_on_a_generate_server_is_400(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.embeddings.create(model="tiny", input="hello")
    assert "does not support Embeddings API" in e.value.body["message"]
    assert "--runner pooling" in e.value.body["message"]
    # The server still generates.
    assert client.completions.create(model="tiny", prompt="hi", max_tokens=2).choices
