"""Tool calls with the official `openai` package, against a server started with
`jaxllm serve --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3`
(vLLM's flags; with Qwen3 as the model, `tool_choice="auto"` lets it decide).
OPENAI_BASE_URL / OPENAI_API_KEY override the defaults."""
import json
import os

from openai import OpenAI

client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"),
                api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))
tools = [{"type": "function", "function": {
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"], "additionalProperties": False}}}]
messages = [{"role": "user", "content": "What is the weather in Paris?"}]

# "required": the model must call a tool; its arguments always match the schema.
reply = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                       tools=tools, tool_choice="required", max_tokens=64)
call = reply.choices[0].message.tool_calls[0]
print(call.function.name, json.loads(call.function.arguments))

# The tool's result goes back as a "tool" turn; the model answers with it.
messages += [reply.choices[0].message.model_dump(exclude_none=True),
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
answer = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages,
                                        tools=tools, max_tokens=32, temperature=0)
message = answer.choices[0].message
# With a reasoning parser, a thinking model's thoughts come apart from its answer
# (None for a model that does not think).
print(getattr(message, "reasoning_content", None), "|", message.content)
