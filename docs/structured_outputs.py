"""Structured outputs with the official `openai` package: the reply parsed into a
pydantic model. OPENAI_BASE_URL / OPENAI_API_KEY override the defaults."""
import os

from openai import OpenAI
from pydantic import BaseModel, Field


class City(BaseModel):
    name: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=40)


client = OpenAI(base_url=os.environ.get("OPENAI_BASE_URL", "http://localhost:8000/v1"),
                api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"))

completion = client.chat.completions.parse(
    model="SmolLM2-135M-Instruct",
    messages=[{"role": "user", "content": "A city in France and its population, as JSON."}],
    response_format=City,
    max_tokens=64,
    temperature=0,
)
city = completion.choices[0].message.parsed
print(city.name, city.population_millions)
