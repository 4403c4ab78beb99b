#!/usr/bin/env bash
# Ask a running `jaxllm serve` with curl. OPENAI_BASE_URL / OPENAI_API_KEY override
# the defaults (the key matters only if the server was started with --api-key).
set -euo pipefail
BASE_URL=${OPENAI_BASE_URL:-http://localhost:8000/v1}
AUTH="Authorization: Bearer ${OPENAI_API_KEY:-EMPTY}"

# A chat completion.
curl -sS "$BASE_URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "Name three colors."}],
  "max_tokens": 32,
  "temperature": 0
}'
echo

# A streamed completion: server-sent events, ending with "data: [DONE]".
curl -sS -N "$BASE_URL/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "SmolLM2-135M-Instruct",
  "prompt": "The capital of France is",
  "max_tokens": 16,
  "stream": true
}'
