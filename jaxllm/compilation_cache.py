"""The persistent XLA compilation cache: a second start of the same config loads its
compiled steps from disk instead of compiling them again.

`enable(path)` must run before the first jax compilation of the process. The same
folder holds the runner's executable store (runner/executable_store.py, subfolder
`jaxllm-executables`): the warm-up's programs, which a restart loads without even
tracing them; this cache still serves every other program and a store miss.
"""
from __future__ import annotations

import os

DEFAULT_DIR = os.path.join("~", ".cache", "jaxllm", "xla")
# jax.monitoring events counted for `summary()`.
_REQUESTS = "/jax/compilation_cache/compile_requests_use_cache"
_HITS = "/jax/compilation_cache/cache_hits"
_counts = {_REQUESTS: 0, _HITS: 0}
_enabled_dir: str | None = None


def enable(path: str | None) -> str | None:
    """Point jax's persistent cache at `path` (None: leave it off). Returns the folder."""
    global _enabled_dir
    if path is None:
        return None
    import jax
    path = os.path.abspath(os.path.expanduser(path))
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # jax caches only compiles slower than 1 s by default; on CPU most take less, and
    # a step loaded from disk is always cheaper than one compiled again.
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    if _enabled_dir is None:
        jax.monitoring.register_event_listener(_count)
    _enabled_dir = path
    return path


def _count(event: str, **_) -> None:
    if event in _counts:
        _counts[event] += 1


def summary() -> str | None:
    """'compilation cache <dir>: H hits, M compiled', or None when the cache is off."""
    if _enabled_dir is None:
        return None
    hits = _counts[_HITS]
    return (f"compilation cache {_enabled_dir}: {hits} hits, "
            f"{_counts[_REQUESTS] - hits} compiled")
