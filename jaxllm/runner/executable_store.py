"""Compiled step programs kept on disk, so a restart loads them without tracing.

jax's persistent compilation cache skips only XLA's compile: a restart still traces
and lowers every bucket of the unrolled model in Python to compute that cache's key
(~2.5 s a bucket on the 2-core CPU, most of an H200 warm restart). This store keys
each executable by what could change its program instead, and keeps it serialized
(`jax.experimental.serialize_executable`) under `<compilation cache dir>/
jaxllm-executables/<key>.bin`:

- jax / jaxlib / PJRT plugin versions, XLA_FLAGS, the jax flags that change a
  lowering and the JAXLLM_* switches read while tracing (TRACE_SWITCHES); the
  platform, its version, the device kind and count, the process count; the mesh's
  shape and device ids;
- the structure, shapes, dtypes and shardings of every argument (weights, KV pool,
  the bucket's inputs) and the static arguments (attention spec, sampler flags);
- the model arch, the engine settings that reach the step (`static` of the store);
- a hash of the source of the jaxllm and pallas_kernels packages.

A file that cannot be read or loaded is skipped with a warning and compiled again.
Each file starts with a digest of its contents, so a damaged one never reaches XLA.
A program that loads but fails its first run is evicted (`evict`) and compiled again
by the compilation manager (runner/compilation.py).

Only fresh compiles are saved. An executable that jax's persistent cache served (a
hit inside `lowered.compile()`) is used but not saved: on XLA:CPU a deserialized
executable serialized again lacks kernels, and loading that copy fails on its first
run ("Function wrapped_iota not found (type id: 1)"). jax's cache serves such hits
whenever it holds a program the store does not: two buckets that lower to the same
HLO (decode-only and mixed at T = S), or every program once a source edit changed the
store's keys. Those programs come from jax's cache on each start instead.

Every key changes with the source, so each upgrade (or edit) adds a new set of files.
The folder is kept under a size cap, least recently used files first (a load marks its
file used): jax's `jax_compilation_cache_max_size` when set (0 turns the store off, as
it turns jax's cache off), else DEFAULT_MAX_BYTES. Files this process loaded or saved
are never removed by it.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import logging
import os
import pickle
import threading
from typing import Any, NamedTuple

import jax

logger = logging.getLogger(__name__)

FOLDER = "jaxllm-executables"
_MAGIC = b"jaxllm-executable-1\n"
_PACKAGES = ("jaxllm", "pallas_kernels")
DEFAULT_MAX_BYTES = 4 << 30
# Distributions whose version changes what a serialized executable means.
_DISTRIBUTIONS = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda12-pjrt",
                  "jax-cuda13-plugin", "jax-cuda13-pjrt")


@functools.cache
def source_hash() -> str:
    """sha256 over every .py file of the jaxllm and pallas_kernels packages (path and
    bytes; ~100 small files, a few ms, once per process)."""
    h = hashlib.sha256()
    for package in _PACKAGES:
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = list(spec.submodule_search_locations)[0]
        for folder, subfolders, files in os.walk(root):
            subfolders.sort()
            for name in sorted(f for f in files if f.endswith(".py")):
                path = os.path.join(folder, name)
                h.update(f"{package}/{os.path.relpath(path, root)}\0".encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


def _versions() -> list[str]:
    out = []
    for dist in _DISTRIBUTIONS:
        try:
            out.append(f"{dist}=={importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    return out


def signature(tree) -> str:
    """The tree's structure and, per leaf (array, numpy array or ShapeDtypeStruct),
    shape, dtype, weak type and sharding: what a compiled program is specialized to."""
    leaves, treedef = jax.tree.flatten(tree)
    rows = [str(treedef)]
    rows += [f"{x.shape} {x.dtype} {getattr(x, 'weak_type', False)} "
             f"{getattr(x, 'sharding', None)}" for x in leaves]
    return "\n".join(rows)


# JAXLLM_* switches read while tracing that no key part records otherwise (the
# attention spec's and the quantization config's switches are in their reprs).
TRACE_SWITCHES = ("JAXLLM_INT8_ROTATE_KERNEL", "JAXLLM_INT4_MOSAIC", "JAXLLM_W4A16_SETTINGS",
                  "JAXLLM_FP8_MOSAIC", "JAXLLM_W8A16_SETTINGS")


def environment(mesh) -> list[str]:
    """What ties an executable to this process's software and devices."""
    dev = mesh.devices.flat[0]
    return [*_versions(), os.environ.get("XLA_FLAGS", ""),
            *(f"{n}={os.environ.get(n, '')}" for n in TRACE_SWITCHES),
            f"x64={jax.config.jax_enable_x64}",
            f"precision={jax.config.jax_default_matmul_precision}",
            dev.platform, dev.client.platform_version, dev.device_kind,
            f"devices={jax.device_count()} processes={jax.process_count()}",
            f"mesh={dict(mesh.shape)} ids={[d.id for d in mesh.devices.flat]}",
            f"source={source_hash()}"]


def max_bytes() -> int:
    """The store's size cap: jax's compilation cache cap when set (>= 0), else
    DEFAULT_MAX_BYTES. 0: no store."""
    cap = jax.config.jax_compilation_cache_max_size
    return DEFAULT_MAX_BYTES if cap < 0 else cap


class Loaded(NamedTuple):
    compiled: Any                   # jax.stages.Compiled
    peak_bytes: int | None          # device bytes at its peak, from memory_analysis
    from_disk: bool = False         # loaded from a file (the store or jax's cache)


def peak_bytes(compiled) -> int | None:
    """Device bytes a compiled program holds at its peak (per device): arguments,
    outputs not aliased to an argument, and temporaries. None when the backend
    gives no memory analysis."""
    mem = compiled.memory_analysis()
    if mem is None:
        return None
    return (mem.argument_size_in_bytes + mem.output_size_in_bytes
            - mem.alias_size_in_bytes + mem.temp_size_in_bytes)


class ExecutableStore:
    """<cache_dir>/jaxllm-executables/<key>.bin, one serialized executable each.

    `static`: reprs of what every program of this runner shares (model arch,
    engine settings, the weights' signature); see the module docstring."""

    def __init__(self, cache_dir: str, mesh, static: list[str]):
        self.folder = os.path.join(os.path.abspath(os.path.expanduser(cache_dir)), FOLDER)
        self.max_bytes = max_bytes()
        self._used: set[str] = set()        # paths this process loaded or saved
        self.devices = list(mesh.devices.flat)
        h = hashlib.sha256()
        for part in environment(mesh) + static:
            h.update(part.encode() + b"\0")
        self._base = h.digest()
        self.loads = self.saves = 0
        self._lock = threading.Lock()

    def key(self, name: tuple, args) -> str:
        """`name` carries the static arguments; `args` the traced ones."""
        h = hashlib.sha256(self._base)
        h.update(repr(name).encode() + b"\0" + signature(args).encode())
        return h.hexdigest()[:40]

    def path(self, key: str) -> str:
        return os.path.join(self.folder, key + ".bin")

    def load(self, key: str) -> Loaded | None:
        """The stored executable, loaded onto this runner's devices; None when there
        is none or it cannot be loaded (a warning says which and why)."""
        path = self.path(key)
        if not os.path.exists(path):
            return None
        try:
            with open(path, "rb") as f:
                blob, in_tree, out_tree, peak = pickle.loads(_unwrap(f.read()))
            from jax.experimental.serialize_executable import deserialize_and_load
            compiled = deserialize_and_load(blob, in_tree, out_tree,
                                            backend=self.devices[0].client,
                                            execution_devices=self.devices)
        except Exception as e:    # damaged, or written by an incompatible build
            logger.warning("executable store: ignoring %s (%s: %s); compiling it again",
                           path, type(e).__name__, str(e)[:200])
            return None
        try:
            os.utime(path)                  # the LRU clock: mtime
        except OSError:
            pass
        with self._lock:
            self.loads += 1
            self._used.add(path)
        return Loaded(compiled, peak, from_disk=True)

    def save(self, key: str, compiled, peak: int | None) -> None:
        """Write atomically (a reader sees the old file or the whole new one); a
        failure is a warning, never an error. `peak`: peak_bytes(compiled), kept
        beside it (the KV sizing's input, whatever a loaded executable reports)."""
        path = self.path(key)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            from jax.experimental.serialize_executable import serialize
            blob, in_tree, out_tree = serialize(compiled)
            payload = pickle.dumps((blob, in_tree, out_tree, peak),
                                   protocol=pickle.HIGHEST_PROTOCOL)
            os.makedirs(self.folder, exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(_MAGIC + hashlib.sha256(payload).hexdigest().encode() + b"\n")
                f.write(payload)
            os.replace(tmp, path)
        except Exception as e:
            logger.warning("executable store: cannot save %s (%s: %s)", path,
                           type(e).__name__, str(e)[:200])
            if os.path.exists(tmp):
                os.remove(tmp)
            return
        with self._lock:
            self.saves += 1
            self._used.add(path)

    def evict(self, key: str, reason: str) -> None:
        """Remove a stored executable that loaded but failed to run (logged once)."""
        path = self.path(key)
        logger.warning("executable store: %s failed its first run (%s); removed, "
                       "compiling it again", path, reason[:200])
        with self._lock:
            self._used.discard(path)
        try:
            os.remove(path)
        except OSError:
            pass

    def prune(self) -> int:
        """Remove the least recently used files (oldest mtime first) until the folder
        fits `max_bytes`, sparing those this process used. Returns how many went."""
        try:
            names = os.listdir(self.folder)
        except OSError:
            return 0
        entries = []
        for name in names:
            path = os.path.join(self.folder, name)
            try:
                st = os.stat(path)
            except OSError:                 # removed by another process meanwhile
                continue
            entries.append((st.st_mtime, st.st_size, path))
        total, removed = sum(e[1] for e in entries), 0
        with self._lock:
            used = set(self._used)
        for _, size, path in sorted(entries):
            if total <= self.max_bytes:
                break
            if path in used:
                continue
            try:
                os.remove(path)
            except OSError:
                continue
            total, removed = total - size, removed + 1
        if removed:
            logger.info("executable store: removed %d least recently used file(s); "
                        "%.0f MB left (cap %.0f MB)", removed, total / 2**20,
                        self.max_bytes / 2**20)
        return removed


def _unwrap(data: bytes) -> bytes:
    """The payload of a store file, after checking its header and digest."""
    head = len(_MAGIC)
    if data[:head] != _MAGIC:
        raise ValueError("not a jaxllm executable file")
    digest, payload = data[head:head + 64], data[head + 65:]
    if hashlib.sha256(payload).hexdigest().encode() != digest:
        raise ValueError("digest mismatch (damaged file)")
    return payload
