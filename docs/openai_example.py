"""Ask a running `jaxllm serve` with the official `openai` package.

OPENAI_BASE_URL / OPENAI_API_KEY override the defaults (the key matters only if the
server was started with --api-key).
"""
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"),
                api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))

chat = client.chat.completions.create(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "Name three colors."}],
    max_tokens=32,
    temperature=0,
)
print(chat.choices[0].message.content)

stream = client.completions.create(
    model="SmolLM2-135M-Instruct",
    prompt="The capital of France is",
    max_tokens=16,
    stream=True,
)
for chunk in stream:
    print(chunk.choices[0].text, end="", flush=True)
print()
