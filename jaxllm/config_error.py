"""ConfigError, in a module of its own so that config sections kept elsewhere
(jaxllm/spec_decode/config.py) can raise it while jaxllm.config imports them.
Import it from jaxllm.config."""


class ConfigError(ValueError):
    """A bad setting: the message names the key, the value and what to change."""
