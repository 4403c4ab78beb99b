"""SchedulerOutput -> padded, bucketed arrays -> jitted step -> sampled tokens.

``execute_model`` launches a step and returns at once (a ``StepHandle``);
``get_output`` reads its sampled tokens back. Between the two the engine schedules
and launches the next step, so host work overlaps the device. The sampled tokens of
the last step also stay on the device (``_token_buf``, row i = sequence i of that
step): an input token not yet read back is written as ``-(row + 1)`` and the jitted
step takes it from there.

Letter legend: T padded tokens, S padded sequences, B blocks per block-table row,
V vocab, L layers, M the largest sequence bucket.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxllm.config import EngineConfig
from jaxllm.engine.scheduler import KVCacheLostError
from jaxllm.layers.attention import AttentionSpec
from jaxllm.models.loader import LoadedModel
from jaxllm.parallel import distributed, mesh as mesh_lib
from jaxllm.runner import (executable_store, input_batch, kv_cache, packed_leaves,
                           sampling_rows)
from jaxllm.runner.buckets import BucketPlan
from jaxllm.runner.compilation import (CompilationManager, Program, ProgramReplaced,
                                       first_requests_only)
from jaxllm.runner.step_fn import LogitsBuffers, StepJits, dummy_arrays
# Module names of their own: tests spy on them (one call is one trace).
from jaxllm.runner.step_fn import forward as _forward, sample_into as _sample_into
from jaxllm.runner.step_inputs import InputStager, StepInputs, put_replicated
from jaxllm.runner.step_output import StepHandle, read_back, start_copies
from jaxllm.runner.sampler import SamplerOutput, warm_up_variants
from jaxllm.runner.sampling_rows import dummy_metadata

logger = logging.getLogger(__name__)


class ModelRunner:
    def __init__(self, config: EngineConfig, loaded: LoadedModel, mesh, max_model_len: int,
                 max_num_batched_tokens: int, hidden_layers: tuple[int, ...] | None = None):
        """`hidden_layers`: None, or the states an EAGLE head reads, returned by every
        step and kept with its StepHandle (step_fn.forward)."""
        self.config = config
        self.hidden_layers = hidden_layers
        self.arch = loaded.arch
        self.graphdef, self.state, self.quant = loaded.graphdef, loaded.state, loaded.quant
        self.mesh = mesh
        self.block_size = config.cache.block_size
        self.max_model_len = max_model_len
        self.max_blocks_per_seq = -(-max_model_len // self.block_size)
        self.plan = BucketPlan.build(max_num_batched_tokens, input_batch.max_rows(config))
        mesh_lib.validate_tp(self.arch.num_heads, self.arch.num_kv_heads, mesh.size)  # TP
        backend = config.attention_backend
        if backend == "auto":
            backend = "pallas" if jax.devices()[0].platform == "gpu" else "reference"
        self.spec = AttentionSpec(
            sm_scale=self.arch.head_dim ** -0.5, backend=backend,
            sliding_window=self.arch.sliding_window, mesh=mesh,
            **kv_cache.spec_kv_scales(loaded.kv_scales, config.cache),
            # Pallas on a CPU runs its kernels through the interpreter (tests).
            interpret=backend == "pallas" and jax.devices()[0].platform == "cpu")
        self.model_dtype = jax.tree.leaves(self.state)[0].dtype
        self.kv_caches, self.last_hidden, self.num_blocks = None, None, 0
        self._replicated = mesh_lib.replicated(mesh)
        self._token_buf = jnp.zeros(self.plan.max_seqs, jnp.int32, device=self._replicated)
        self.logits_bufs = LogitsBuffers(self.arch.vocab_size, self._replicated, self.plan)
        self._stager = InputStager()
        self._prev_rows: dict[str, int] = {}   # request id -> its row in _token_buf
        self._row_entries: dict[str, sampling_rows.RowEntry] = {}   # by request id
        self.params, self.param_layout = packed_leaves.flatten(self.state)
        self._step_jit = StepJits(functools.partial(
            _forward, self.graphdef, self.param_layout, self.spec, hidden_layers), self.params,
            self.out_shardings())
        self._sample = jax.jit(_sample_into, static_argnums=(2,), donate_argnums=(3,))
        self.store = self._open_store(self.param_layout)
        # Warm-up programs run directly; loading holds the GIL on a CPU (executable_store).
        cpu = mesh.local_devices[0].platform == "cpu"
        self.compilation = CompilationManager(self.store, min(os.cpu_count() or 1, 16),
                                              1 if cpu else 8, self._rebuild_program,
                                              jax.process_count() == 1)

    def _open_store(self, layout) -> executable_store.ExecutableStore | None:
        """The executable store, when a compilation cache folder is configured and jax's
        cache is not capped at 0; not with several processes (unverified there)."""
        if (self.config.compilation_cache_dir is None or jax.process_count() > 1
                or executable_store.max_bytes() == 0):
            return None
        kv_dtype = kv_cache.cache_dtype(self.config.cache, self.model_dtype)
        static = [repr(self.arch), repr(self.spec), str(layout), repr(self.quant),
                  executable_store.signature(self.params), repr(self.plan),
                  f"block_size={self.block_size} kv_dtype={kv_dtype} max_model_len="
                  f"{self.max_model_len} step donates (1, 4), sampler (3,), out_shardings="
                  f"{self.out_shardings()}"]
        static += [self._step_jit.describe(self.plan.token_buckets)]
        static += [f"returns hidden_layers={self.hidden_layers}"] * (
            self.hidden_layers is not None)
        return executable_store.ExecutableStore(self.config.compilation_cache_dir, self.mesh,
                                                static)

    def out_shardings(self) -> tuple:
        """The step's: logits whole on every device (the sampler reads whole rows),
        the pool split by KV head, an EAGLE head's states whole."""
        out = (self._replicated, mesh_lib.kv_cache_sharding(self.mesh))
        return out + (self._replicated,) * (self.hidden_layers is not None)

    # ------------------------------------------------------------ KV pool
    def initialize_kv_cache(self, draft_per_block=0, draft_weights=0) -> kv_cache.MemoryReport:
        """Size and allocate the pool; on a GPU from the largest step's compiled memory
        analysis (kv_cache.fit_to_device), compiled while the warm-up's other programs
        are lowered for the same pool and queued (warm_up collects them; a pool of
        another size makes them stale). `draft_*`: a proposer's pool bytes per block
        and weights, left room for (plan_num_blocks); quantized weights' savings too."""
        cache_cfg = self.config.cache
        weights = kv_cache.device_bytes(self.params)
        limit = self.device_limit()
        dtype = kv_cache.cache_dtype(cache_cfg, self.model_dtype)
        sharding = mesh_lib.kv_cache_sharding(self.mesh, self.arch.num_kv_heads)
        t, s = self.plan.token_buckets[-1], self.plan.max_seqs
        extra = dict(draft_per_block=draft_per_block, draft_weights=draft_weights,
                     unquantized_extra=kv_cache.unquantized_extra(
                         self.quant, self.arch, self.model_dtype, self.state, self.mesh))

        def step_peak(num_blocks: int) -> int | None:
            pool = kv_cache.abstract(self.arch, num_blocks, self.block_size, dtype, sharding,
                                     tp=self.mesh.size)
            programs = [self._step_program(t, s, False, pool)]
            if not self.config.enforce_eager:
                programs += self.warm_up_programs(pool)
            self.compilation.queue_programs(num_blocks, programs)
            peak = self.compilation.queue.result(("step", t, s, False)).peak_bytes
            # The smaller buckets' logits buffers stay on the device beside this step.
            return None if peak is None else peak + self.logits_bufs.extra_bytes()

        if limit is not None and cache_cfg.num_gpu_blocks_override is None:
            report = kv_cache.fit_to_device(
                self.arch, cache_cfg, self.model_dtype, self.max_model_len, weights, limit,
                kv_cache.activation_bound(
                    self.arch, t, s, self.model_dtype, self.mesh.size,
                    gather_block_size=self.block_size * (self.spec.backend == "reference")),
                step_peak, num_devices=self.mesh.size, **extra)
        else:
            report = kv_cache.plan_num_blocks(
                self.arch, cache_cfg, self.model_dtype, self.max_model_len, weights, None, None,
                num_devices=self.mesh.size, max_num_seqs=self.config.scheduler.max_num_seqs,
                **extra)
        # Multi-host: one pool spans the processes, so all must size it alike.
        report = dataclasses.replace(report, num_blocks=distributed.agree_min(report.num_blocks))
        self.num_blocks = report.num_blocks
        self.kv_caches = self._allocate_pool()
        self.compilation.settle_queue(report.num_blocks, collect=self.config.enforce_eager)
        logger.info("KV cache: %s", report.describe(self.block_size))
        return report

    def _allocate_pool(self):
        """A zeroed pool of self.num_blocks blocks."""
        return kv_cache.allocate(
            self.arch, self.num_blocks, self.block_size,
            kv_cache.cache_dtype(self.config.cache, self.model_dtype),
            mesh_lib.kv_cache_sharding(self.mesh, self.arch.num_kv_heads), tp=self.mesh.size)

    def device_limit(self) -> int | None:
        """The device's byte limit; None on CPU, where the pool has a configured size."""
        dev = self.mesh.local_devices[0]
        stats = dev.memory_stats() if dev.platform == "gpu" else None
        return stats.get("bytes_limit") if stats else None

    # ------------------------------------------------------------ inputs
    def prepare_inputs(self, scheduled) -> tuple[dict, bool, int]:
        """Host numpy buffers for one step: (arrays, decode_only, rows)."""
        return input_batch.prepare_inputs(
            scheduled, self.plan, self.block_size, self.max_blocks_per_seq, self._prev_rows,
            self.compilation.ready_now, self.spec.folds_kv_write)

    # ------------------------------------------------------------ execution
    def step_args(self, arrays: dict, decode_only: bool, kv_caches=None) -> tuple:
        """The step's arguments for host `arrays`, packed into one transfer. The
        warm-up lowers with these very arguments, so its programs are the ones called.
        `kv_caches`: another pool than the runner's (the KV sizing's abstract one)."""
        inputs = StepInputs.pack(arrays, decode_only, self._replicated)   # (not staged)
        kv_caches = self.kv_caches if kv_caches is None else kv_caches
        args = (self.params, kv_caches, self._token_buf, inputs)
        if "prompt_targets" in arrays:      # (the prompt step's jit: a new logits array)
            return args + (None, jax.device_put(arrays["prompt_targets"], self._replicated))
        return args + (self.logits_bufs.spec(inputs.num_seqs),)

    def launch_step(self, arrays: dict, decode_only: bool, prompt_targets=None):
        """The step's logits (with prompt_targets: and its prompt logprobs); an EAGLE
        head's states, when the runner returns them, are left in `last_hidden`."""
        if prompt_targets is not None:
            args = self.step_args(dict(arrays, prompt_targets=prompt_targets), decode_only)
            step = self._step_jit(len(arrays["input_ids"]), prompt=True)
            logits, self.kv_caches, prompt, *hidden = step(*args)
            self.last_hidden = hidden[0] if hidden else None
            return logits, prompt
        return self.launch_packed(self.pack_inputs(arrays, decode_only))

    def pack_inputs(self, arrays: dict, decode_only: bool) -> StepInputs:  # one transfer
        return self._stager.stage(StepInputs.pack(arrays, decode_only, self._replicated))

    def launch_packed(self, inputs: StepInputs):
        """launch_step on inputs pack_inputs made (benchmarks time the two apart)."""
        key = ("step", inputs.num_tokens, inputs.num_seqs, inputs.decode_only)
        args = (self.params, self.kv_caches, self._token_buf, inputs,
                self.logits_bufs.take(inputs.num_seqs))
        logits, self.kv_caches, *hidden = self._call(
            key, args, self._step_jit(inputs.num_tokens), args)
        self.logits_bufs.put(inputs.num_seqs, logits)
        self.last_hidden = hidden[0] if hidden else None
        return logits

    def lower_step(self, arrays: dict, decode_only: bool):
        """The jitted step lowered for host `arrays` (what a call with them runs)."""
        return self._step_jit(len(arrays["input_ids"])).lower(
            *self.step_args(arrays, decode_only))

    def sample_step(self, logits, md, flags, bitmask=None) -> SamplerOutput:
        extra = () if bitmask is None else (bitmask,)
        for last in (False, True):   # again with a new token buffer after a replacement
            try:
                self._token_buf, out = self._call(
                    ("sample", logits.shape[0], flags), (logits, md, self._token_buf, *extra),
                    self._sample, (logits, md, flags, self._token_buf, *extra))
                return out
            except ProgramReplaced:
                if last:
                    raise

    def _call(self, key: tuple, args: tuple, jitted, jit_args: tuple):
        return self.compilation.call(key, args, jitted, jit_args)

    def _rebuild_program(self, key: tuple) -> Program:
        """A warm-up program again after its copy from disk failed to run (what that run
        took, a step's pool or the sampler's token buffer, made anew first)."""
        if key[0] == "step":
            self.kv_caches = self._allocate_pool()
            return self._step_program(*key[1:])
        self._token_buf = jnp.zeros(self.plan.max_seqs, jnp.int32, device=self._replicated)
        return self._sample_program(key[1], key[2])

    def execute_model(self, scheduler_output, requests: dict, fallback_seeds: dict,
                      defer_sample: bool = False, before_dispatch=None) -> StepHandle | None:
        """Launch one step (model and sampler) without waiting for it; None when nothing
        is scheduled. `defer_sample`: the model only (sample_tokens follows, with the
        grammar bitmask). `before_dispatch()` runs just before the model launches, its
        host inputs ready (the engine core launches the previous deferred sampler there)."""
        if not scheduler_output.scheduled:
            return None
        scheduled, spec = input_batch.expand_spec_rows(scheduler_output.scheduled)
        arrays, decode_only, rows = self.prepare_inputs(scheduled)
        targets = input_batch.prompt_targets(scheduled, requests, len(arrays["input_ids"]))
        reqs = [requests[r.request_id] for r in scheduled]
        sampling = None
        if before_dispatch is not None:
            sampling = self._sampling_metadata(scheduled, reqs, rows, fallback_seeds)
            before_dispatch()
        prompt_out = None
        if targets is not None:
            logits, prompt_out = self.launch_step(arrays, decode_only, targets)
        else:
            logits = self.launch_step(arrays, decode_only)
        md, flags = sampling or self._sampling_metadata(scheduled, reqs, rows, fallback_seeds)
        # Which row of the device's sample buffer holds each sampling request's token:
        # the next step's inputs name the tokens not read back yet by those rows.
        self._prev_rows = {r.request_id: i for i, r in enumerate(scheduled) if r.do_sample}
        handle = StepHandle(scheduled, requests, None, flags.num_logprobs, prompt_out,
                            pending=(logits, md, flags), spec=spec, hidden=self.last_hidden)
        if not defer_sample:
            self.sample_tokens(handle, None)
        return handle

    def _sampling_metadata(self, scheduled, reqs, rows: int, fallback_seeds: dict):
        """(host metadata, flags); each request's row entry is kept while it runs."""
        entries, self._row_entries = sampling_rows.kept_entries(
            self._row_entries, reqs, self.arch.vocab_size, fallback_seeds)
        return sampling_rows.build(
            entries, [r.output_index for r in scheduled], rows,
            lambda: [q.prompt_token_ids for q in reqs],
            lambda: input_batch.output_tokens(scheduled, reqs), self._eos_ids())

    def sample_tokens(self, handle: StepHandle, grammar_bitmask) -> None:
        """Launch a step's sampler; grammar_bitmask: None, or i32[S, W] of the sampler's
        S rows, on the host (multi-host, where it was broadcast) or upload_bitmask's."""
        logits, md, flags = handle.pending
        handle.pending = None
        bitmask = grammar_bitmask
        if bitmask is not None:
            flags = dataclasses.replace(flags, use_bitmask=True)
            if isinstance(bitmask, np.ndarray):
                bitmask = self.upload_bitmask(bitmask)
        handle.sampled = self.sample_step(logits, md, flags, bitmask)
        start_copies(handle)

    def sampler_rows(self, handle: StepHandle) -> int:   # S: the bitmask's height
        return handle.pending[0].shape[0]

    def upload_bitmask(self, bitmask: np.ndarray):
        """A host bitmask i32[S, W] on the device (callable from any thread)."""
        return put_replicated(bitmask, self._replicated)

    def get_output(self, handle: StepHandle):
        """Wait for a launched step: (id -> SampleResult, id -> prompt logprob rows)."""
        return read_back(handle)

    def _eos_ids(self) -> tuple[int, ...]:
        return self.arch.eos_token_id

    # ------------------------------------------------------------ warm-up
    def _step_program(self, t: int, s: int, decode_only: bool, kv_caches=None) -> Program:
        """One bucket's step, lowered with a real call's arguments (its store key without
        the weights); its inputs' copies run now, so a warm start compiles nothing."""
        arrays = dummy_arrays(t, s, self.max_blocks_per_seq)
        args = self.step_args(arrays, decode_only, kv_caches)
        self._stager.warm_up(args[3])
        return Program(("step", t, s, decode_only), args[1:], self._step_jit(t), args)

    def _dummy_logits(self, s: int):
        """What the sampler sees from the step: float32 logits [S, V], replicated."""
        return jax.device_put(np.zeros((s, self.arch.vocab_size), np.float32),
                              self._replicated)

    def warm_up_programs(self, kv_caches=None) -> list[Program]:
        """Every bucket's step (on `kv_caches`, else the runner's pool), then the
        sampler variants for each sequence bucket."""
        shapes = self.plan.all_shapes()
        programs = [self._step_program(*shape, kv_caches) for shape in shapes]
        for s in sorted({s for _, s, _ in shapes}):
            programs += [self._sample_program(s, flags) for flags in warm_up_variants()]
        return programs

    def _sample_program(self, s: int, flags) -> Program:
        logits, md = self._dummy_logits(s), dummy_metadata(s)
        extra = (self._dummy_bitmask(s),) if flags.use_bitmask else ()
        return Program(("sample", s, flags), (logits, md, self._token_buf, *extra),
                       self._sample, (logits, md, flags, self._token_buf, *extra))

    def _dummy_bitmask(self, s: int):
        return jax.device_put(np.full((s, -(-self.arch.vocab_size // 32)), -1, np.int32),
                              self._replicated)

    def warm_up(self) -> float:
        """Have every bucket's program (model step and each sampler variant) compiled,
        or loaded from the executable store, and keep them for dispatch. Those the KV
        sizing queued are collected, not lowered again. With compile_in_background, on
        one CPU process, the programs first requests need come first, the rest after."""
        t0, platform = time.perf_counter(), self.mesh.local_devices[0].platform
        one = self.config.parallel.num_processes == 1 and self.config.compile_in_background
        defer = first_requests_only(self.plan) if platform == "cpu" and one else None
        num, queue = self.compilation.warm_up(self.warm_up_programs(), defer)
        t_ready = time.perf_counter()
        if platform == "gpu" and self.config.parallel.num_processes == 1:
            self.run_programs_once()
        elapsed = time.perf_counter() - t0
        logger.info("warm-up: %d programs ready in %.1f s (%d lowered and compiled, %.1f s "
                    "lowering on this thread; %.1f s running each once)%s%s", num,
                    elapsed, queue.num_lowered, queue.t_lower, elapsed - (t_ready - t0),
                    f" ({self.store.loads} loaded from the executable store)"
                    if self.store else "", f"; {len(self.compilation.background)} more "
                    "compiling in the background" if self.compilation.background else "")
        return elapsed

    def run_programs_once(self) -> None:
        """Run every warmed-up program once on padding inputs (no KV slot written, no
        sequence read). A program's first run on a GPU loads its kernels and builds
        its CUDA graphs, here rather than in the first requests' steps, as vLLM's
        dummy runs do; a program read from a file that fails here is compiled again
        (`_call`). It costs 1.0-1.5 s of an 8B start on the H200. Multi-host runs
        skip it: every process would have to run the same programs in step."""
        def run(key):
            if key[0] == "step":
                return self.launch_step(dummy_arrays(key[1], key[2], self.max_blocks_per_seq),
                                        key[3])
            bitmask = self._dummy_bitmask(key[1]) if key[2].use_bitmask else None
            return self.sample_step(self._dummy_logits(key[1]), dummy_metadata(key[1]),
                                    key[2], bitmask)
        out = None
        for key in sorted(self.compilation.programs, key=str):
            try:
                out = run(key)
            except KVCacheLostError:   # replaced; the pool holds nothing yet
                out = run(key)
        jax.block_until_ready((out, self.kv_caches))

    # ------------------------------------------------------------ swap
    def swap_out(self, pairs, host_pool):      # pairs [(gpu, cpu)]: device to host
        kv_cache.swap_out(self.kv_caches, pairs, host_pool)

    def swap_in(self, pairs, host_pool):       # pairs [(cpu, gpu)]: host to device
        self.kv_caches = kv_cache.swap_in(self.kv_caches, pairs, host_pool)

    def host_pool(self, num_cpu_blocks: int):
        return kv_cache.allocate_host_pool(self.kv_caches, num_cpu_blocks)

