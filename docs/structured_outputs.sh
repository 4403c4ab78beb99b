#!/usr/bin/env bash
# Structured outputs from a running `jaxllm serve` with curl. OPENAI_BASE_URL /
# OPENAI_API_KEY override the defaults, as in openai_examples.sh.
set -euo pipefail
BASE_URL=${OPENAI_BASE_URL:-http://localhost:8000/v1}
AUTH="Authorization: Bearer ${OPENAI_API_KEY:-EMPTY}"

# JSON that follows a schema (OpenAI's response_format).
curl -sS "$BASE_URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "A city in France and its population, as JSON."}],
  "max_tokens": 64,
  "temperature": 0,
  "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "additionalProperties": false,
    "properties": {"name": {"type": "string", "maxLength": 24},
                   "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
    "required": ["name", "population_millions"]}}}
}'
echo

# One of a few answers (vLLM's structured_outputs; also regex, grammar, json).
curl -sS "$BASE_URL/chat/completions" -H "Content-Type: application/json" -H "$AUTH" -d '{
  "model": "SmolLM2-135M-Instruct",
  "messages": [{"role": "user", "content": "Is Paris in France?"}],
  "max_tokens": 4,
  "structured_outputs": {"choice": ["yes", "no"]}
}'
