"""0/1 environment switches (JAXLLM_*), read one way: unset gives the default, any value
but "0" or "1" is refused in one line naming the variable. No jax here, so the config
and the engine's jax-free modules can read them too."""
from __future__ import annotations

import os


def env_switch(name: str, default: bool = False) -> bool:
    value = os.environ.get(name)
    if value is None:
        return default
    if value not in ("0", "1"):
        raise ValueError(f"{name}={value!r}: 0 or 1 expected")
    return value == "1"
