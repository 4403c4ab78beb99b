"""`speculative_config`: vLLM's keys, checked once, every mistake one line.

    LLM(speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    jaxllm serve --speculative-config '{"model": "DRAFT_DIR", "num_speculative_tokens": 3}'
    config file:  speculative_config: {method: eagle3, model: HEAD_DIR, num_speculative_tokens: 4}

As in vLLM, `method` may be left out when `model` is given: a name holding "eagle-"
means eagle, one holding "eagle3" means eagle3, any other is a draft model; the model
"ngram" (or "[ngram]", vLLM's old spelling) means the ngram method. For ngram,
prompt_lookup_min and prompt_lookup_max default to 5 each, and when only one is given
the other takes its value (vLLM's rules).

Pure Python: imports no jax (the CLI checks a config before anything loads).
"""
from __future__ import annotations

import dataclasses
import difflib
import json
from dataclasses import dataclass

# Not from jaxllm.config: it imports this module (for EngineConfig's field).
from jaxllm.config_error import ConfigError

# Speculation runs while at most this many requests are running; above it each verify
# step costs more device time than the accepted drafts save (set from the H200
# measurements of the verify step against plain decode).
DEFAULT_DISABLE_BY_BATCH_SIZE = 32

METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# vLLM methods jaxllm does not implement: named as such rather than as typos.
VLLM_ONLY_METHODS = ("medusa", "mlp_speculator", "mtp", "suffix", "ngram_gpu",
                     "custom_class", "dflash", "extract_hidden_states")
# Each of the k drafts adds a position to every verified sequence (the verify step
# scores k + 1 positions, compiled per width at warm-up, and the scheduler reserves
# k KV slots per request). Acceptance decays geometrically with the position: at a
# per-token acceptance of 0.8, drafts past the 16th add under 0.12 expected tokens a
# step while each still costs a position, so larger k only slows a step down.
MAX_SPECULATIVE_TOKENS = 16
NGRAM_DEFAULT_LOOKUP = 5       # vLLM's default for both bounds ("arbitrarily chosen")
_NGRAM_MODEL_NAMES = ("ngram", "[ngram]")
# vLLM keys that jaxllm does not take (an unknown-key error says so, not "typo").
_VLLM_ONLY_KEYS = ("draft_tensor_parallel_size", "quantization", "max_model_len",
                   "revision", "code_revision", "enforce_eager", "disable_logprobs",
                   "disable_log_stats", "draft_sample_method", "rejection_sample_method",
                   "parallel_drafting", "use_heterogeneous_vocab", "tensor_parallel_size",
                   "disable_padded_drafter_batch", "kv_cache_dtype", "attention_backend")
_EXAMPLE = '\'{"method": "ngram", "num_speculative_tokens": 4}\''


def _error(message: str) -> ConfigError:
    return ConfigError(message)


def _where(source: str | None) -> str:
    return f" ({source})" if source else ""


@dataclass(frozen=True)
class SpeculativeConfig:
    """One engine's speculative decoding. `method` is always set after construction
    (inferred from `model` when not given); prompt_lookup_* are set for ngram only."""
    num_speculative_tokens: int
    method: str | None = None
    model: str | None = None             # the draft model's or EAGLE head's folder
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # vLLM's key: no speculation in a step with more running requests than this.
    # None: DEFAULT_DISABLE_BY_BATCH_SIZE (read when used, see effective_...).
    disable_by_batch_size: int | None = None

    def __post_init__(self):
        self._check_types()
        self._resolve_method()
        k = self.num_speculative_tokens
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise _error(f"speculative_config.num_speculative_tokens={k}: must be in "
                         f"1..{MAX_SPECULATIVE_TOKENS} (each draft adds a position to "
                         "every verify step; see MAX_SPECULATIVE_TOKENS)")
        if self.method == "ngram":
            self._resolve_ngram()
        else:
            for key in ("prompt_lookup_min", "prompt_lookup_max"):
                if getattr(self, key) is not None:
                    raise _error(f"speculative_config.{key}={getattr(self, key)}: applies "
                                 f"to method 'ngram' only, not {self.method!r}; drop it")
        limit = self.disable_by_batch_size
        if limit is not None and limit < 2:     # vLLM's bound
            raise _error(f"speculative_config.disable_by_batch_size={limit}: must be >= 2 "
                         "(leave it unset for the measured default, "
                         f"{DEFAULT_DISABLE_BY_BATCH_SIZE})")

    def _check_types(self) -> None:
        for key in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                    "disable_by_batch_size"):
            value = getattr(self, key)
            if value is None and key != "num_speculative_tokens":
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                hint = (f"; e.g. {_EXAMPLE}" if value is None else "")
                raise _error(f"speculative_config.{key}={value!r}: give a whole number"
                             + (" (it is required)" if value is None else "") + hint)
        for key in ("method", "model"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, str) or not value):
                raise _error(f"speculative_config.{key}={value!r}: give a non-empty string")

    def _resolve_method(self) -> None:
        method, model = self.method, self.model
        if method == "[ngram]":     # vLLM's old spelling
            method = "ngram"
        if model is not None and model.lower() in _NGRAM_MODEL_NAMES and method in (None, "ngram"):
            method, model = "ngram", None
        if method is None:
            if model is None:
                raise _error("speculative_config: give method (one of "
                             f"{', '.join(METHODS)}) or model (a draft or EAGLE head "
                             f"folder); e.g. {_EXAMPLE}")
            name = model.lower()     # vLLM's inference, from the name as given
            method = ("eagle" if "eagle-" in name else "eagle3" if "eagle3" in name
                      else "draft_model")
        if method not in METHODS:
            why = ("a vLLM method jaxllm does not implement" if method in VLLM_ONLY_METHODS
                   else "unknown")
            raise _error(f"speculative_config.method={method!r}: {why}; choose one of "
                         f"{', '.join(METHODS)}")
        if method == "ngram" and model is not None:
            raise _error(f"speculative_config.model={model!r}: method 'ngram' takes no "
                         "model (it looks up the request's own tokens); drop model")
        if method != "ngram" and model is None:
            what = "draft model's" if method == "draft_model" else "EAGLE head's"
            raise _error(f"speculative_config.model: method {method!r} needs model, the "
                         f"{what} folder")
        object.__setattr__(self, "method", method)
        object.__setattr__(self, "model", model)

    def _resolve_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = NGRAM_DEFAULT_LOOKUP
        lo, hi = (hi if lo is None else lo), (lo if hi is None else hi)
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value < 1:
                raise _error(f"speculative_config.{key}={value}: must be >= 1")
        if lo > hi:
            raise _error(f"speculative_config.prompt_lookup_min={lo} is above "
                         f"prompt_lookup_max={hi}; lower the min or raise the max")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)

    # ------------------------------------------------------------ derived values
    @property
    def effective_disable_by_batch_size(self) -> int:
        """The running-request count above which a step does not speculate."""
        if self.disable_by_batch_size is not None:
            return self.disable_by_batch_size
        return DEFAULT_DISABLE_BY_BATCH_SIZE

    @property
    def uses_draft_model(self) -> bool:
        """A model of its own (draft or EAGLE head) with its own KV, not prompt lookup."""
        return self.method != "ngram"

    # ------------------------------------------------------------ parsing
    @classmethod
    def from_value(cls, value, source: str | None = None) -> "SpeculativeConfig | None":
        """A SpeculativeConfig from a dict, a JSON object string (the CLI flag's), a
        SpeculativeConfig, or None. `source` (a flag or a file) goes into errors."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            value = _parse_json(value, source)
        if not isinstance(value, dict):
            raise _error(f"speculative_config={value!r}{_where(source)}: give a mapping "
                         f"of its keys, e.g. {_EXAMPLE}")
        fields = {f.name for f in dataclasses.fields(cls)}
        items = {}
        for key, item in value.items():
            name = str(key).replace("-", "_")
            if name not in fields:
                raise _unknown_key(key, fields, source)
            items[name] = item
        if "num_speculative_tokens" not in items:
            raise _error(f"speculative_config.num_speculative_tokens{_where(source)}: "
                         f"required (how many tokens to draft a step, 1.."
                         f"{MAX_SPECULATIVE_TOKENS}); e.g. {_EXAMPLE}")
        try:
            return cls(**items)
        except ValueError as e:     # a ConfigError: add where the value came from
            if not source:
                raise
            raise _error(f"{e} ({source})") from None


def _parse_json(text: str, source: str | None) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise _error(f"speculative_config={text!r}{_where(source)}: not valid JSON "
                     f"({e.msg} at character {e.pos}); give an object such as "
                     f"{_EXAMPLE}") from None


def _unknown_key(key, fields, source):
    name = str(key).replace("-", "_")
    if name in _VLLM_ONLY_KEYS:
        return _error(f"speculative_config.{key}{_where(source)}: a vLLM key jaxllm does "
                      f"not take; keys: {', '.join(sorted(fields))}")
    close = difflib.get_close_matches(name, sorted(fields), n=1, cutoff=0.6)
    fix = f"did you mean {close[0]!r}?" if close else f"keys: {', '.join(sorted(fields))}"
    return _error(f"speculative_config: unknown key {key!r}{_where(source)}; {fix}")


def check_draft_vocab(target_vocab_size: int, draft_vocab_size: int, draft_path: str) -> None:
    """A draft (or an EAGLE head's embedding) must have the target's vocabulary: its
    token ids are verified by the target as they are. Exact equality, as vLLM's
    draft-model check (a padded vocabulary of another size is refused too). For an
    EAGLE-3 head pass its `vocab_size` (the embedding, the target's), not its
    `draft_vocab_size` (the reduced output vocabulary, mapped by its d2t table)."""
    if target_vocab_size != draft_vocab_size:
        raise _error(f"speculative_config.model={draft_path!r}: its vocabulary has "
                     f"{draft_vocab_size} tokens, the target's {target_vocab_size}; a draft "
                     "must share the target's tokenizer and vocabulary size")
