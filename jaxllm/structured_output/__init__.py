"""Structured outputs: token masks from a grammar (llguidance) so a request's output
follows a JSON schema, a regex, a choice or a grammar. See manager.py for the engine's
side and backend_guidance.py for the library."""
from jaxllm.structured_output.backend_guidance import validate

__all__ = ["validate"]
