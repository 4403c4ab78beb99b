#!/usr/bin/env bash
# A chat completion with the thinking switched off for Qwen3-style templates
# (chat_template_kwargs), from a server started with --reasoning-parser qwen3. A
# thinking model's thoughts come back in "reasoning" and "reasoning_content", the
# answer in "content". OPENAI_BASE_URL / OPENAI_API_KEY override the defaults.
set -euo pipefail
BASE_URL=${OPENAI_BASE_URL:-http://localhost:8000/v1}
AUTH="Authorization: Bearer ${OPENAI_API_KEY:-EMPTY}"
curl -sS "$BASE_URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "Say hello."}],
  "max_tokens": 16,
  "temperature": 0,
  "chat_template_kwargs": {"enable_thinking": false}
}'
