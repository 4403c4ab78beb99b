"""SamplingParams: how one request is sampled, with vLLM's names and semantics.

Validated once, in ``__post_init__``; a bad value raises ``ValueError`` naming the
field and its allowed range. Pure Python: the scheduler and engine import this.
"""

from __future__ import annotations

import enum
import json
from dataclasses import dataclass

# Below this a temperature is treated as 0 (greedy), as in vLLM.
SAMPLING_EPS = 1e-5
# Most top logprobs a request may ask for; the sampler computes exactly this many
# for a batch that wants any, so the number is a compile-time constant.
MAX_LOGPROBS = 20
# Bounds no real client's request reaches (OpenAI allows n <= 128 and 4 stop strings),
# so that one request cannot make every step scan 100,000 stop strings.
MAX_N = 128
MAX_STOP_STRINGS = 128
MAX_STOP_STRING_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024


class RequestOutputKind(enum.Enum):
    """What the engine returns for a request after a step (vLLM's names)."""
    CUMULATIVE = 0   # every step: the whole output so far (the server streams these)
    FINAL_ONLY = 2   # only once, when finished (LLM.generate: no per-step work)


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class StructuredOutputsParams:
    """One constraint on a request's output (vLLM's ``StructuredOutputsParams``):
    exactly one of ``json`` (a JSON schema, dict or string), ``regex``, ``choice``
    (the output is one of these strings), ``grammar`` (Lark or GBNF) or
    ``json_object`` (any JSON object). ``whitespace_pattern`` (a regex) replaces the
    whitespace allowed between JSON tokens; ``disable_any_whitespace`` allows none."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs takes exactly one constraint of "
                f"{', '.join(self.KINDS)}; got {', '.join(given) if given else 'none'}")
        if isinstance(self.json, str):
            try:
                self.json = json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        _check(self.json is None or isinstance(self.json, (dict, bool)),
               "structured_outputs.json", type(self.json).__name__, "a JSON schema object")
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, str) and value),
                   f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            _check(isinstance(self.choice, (list, tuple)) and len(self.choice) > 0
                   and all(isinstance(c, str) and c for c in self.choice),
                   "structured_outputs.choice", self.choice,
                   "a non-empty list of non-empty strings")
            self.choice = list(self.choice)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> str:
        """What identifies the compiled grammar (the compile cache's key)."""
        return json.dumps([self.kind, getattr(self, self.kind), self.disable_any_whitespace,
                           self.disable_additional_properties, self.whitespace_pattern],
                          sort_keys=True)


@dataclass
class SamplingParams:
    """Sampling parameters for one request (vLLM's ``SamplingParams``).

    ``top_k`` 0 or -1 turns top-k off (-1 is normalised to 0). ``max_tokens=None``
    means "up to max_model_len". ``stop`` is normalised to a list of strings and
    ``stop_token_ids`` to a list of ints.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self) -> None:
        self._normalize()
        self._verify_args()
        if self.is_greedy:
            # Filters are meaningless for argmax; resetting them keeps a greedy
            # request from switching the batch onto the slower filtering path.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _normalize(self) -> None:
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams(**self.structured_outputs)

    def _verify_args(self) -> None:
        _check(isinstance(self.n, int) and 1 <= self.n <= MAX_N, "n", self.n,
               f"an int in [1, {MAX_N}]")
        _check(self.temperature >= 0.0, "temperature", self.temperature, ">= 0 (0 = greedy)")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "in (0, 1]")
        _check(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k,
               "-1 or 0 (off) or an int >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "in [0, 1]")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(-2.0 <= value <= 2.0, name, value, "in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "> 0 (1 = off)")
        _check(self.seed is None or (isinstance(self.seed, int)
                                     and -(1 << 63) <= self.seed < (1 << 63)),
               "seed", self.seed, "None or an int64 (in [-2**63, 2**63 - 1])")
        if self.max_tokens is not None:
            _check(isinstance(self.max_tokens, int) and self.max_tokens >= 1, "max_tokens",
                   self.max_tokens, "an int >= 1 or None")
        upper = "max_tokens" if self.max_tokens is not None else "infinity"
        _check(isinstance(self.min_tokens, int)
               and 0 <= self.min_tokens <= (self.max_tokens or float("inf")),
               "min_tokens", self.min_tokens, f"in [0, {upper}={self.max_tokens}]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            _check(value is None or (isinstance(value, int) and 0 <= value <= MAX_LOGPROBS),
                   name, value, f"None or an int in [0, {MAX_LOGPROBS}]")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "non-empty strings")
        _check(len(self.stop) <= MAX_STOP_STRINGS
               and all(len(s) <= MAX_STOP_STRING_CHARS for s in self.stop), "stop",
               f"{len(self.stop)} strings of up to {max(map(len, self.stop), default=0)} chars",
               f"at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS} chars")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)
               and len(self.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids",
               self.stop_token_ids if len(self.stop_token_ids) <= 8 else
               f"{len(self.stop_token_ids)} ids", f"at most {MAX_STOP_TOKEN_IDS} non-negative ints")

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def uses_penalties(self) -> bool:
        """True when the sampler must build per-token counts for this request."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def uses_filters(self) -> bool:
        """True when top-k, top-p or min-p changes the distribution."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @property
    def stop_buffer_length(self) -> int:
        """Chars of streamed text to hold back while a stop string may be forming."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1


def _check(ok: bool, name: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name} must be {allowed}, got {value!r}.")
