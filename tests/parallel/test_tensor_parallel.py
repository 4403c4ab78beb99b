"""Tensor parallelism. The model-level cases need 8 devices: they run in a child
process with 8 host devices (tp8_cases.py). The rest is the rules arithmetic, here."""
from __future__ import annotations

import pytest

from jaxllm.config import CacheConfig, ConfigError
from jaxllm.models.registry import ArchConfig
from jaxllm.parallel import mesh as mesh_lib
from jaxllm.runner import kv_cache
from tp_util import host_devices_env, run_child


def test_tp_cases_on_8_host_devices():
    proc = run_child(["-m", "pytest", "tests/parallel/tp8_cases.py", "-q", "-x",
                      "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
                     host_devices_env(8), timeout=600)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]


def test_valid_tp_sizes():
    assert mesh_lib.valid_tp_sizes(32, 8) == [1, 2, 4, 8, 16, 32]      # Llama-3.1-8B
    assert mesh_lib.valid_tp_sizes(12, 4) == [1, 2, 4, 12]             # 3, 6: a KV head split
    with pytest.raises(ConfigError, match=r"--tensor-parallel-size 3 does not divide the "
                                          r"model's 32 query heads"):
        mesh_lib.validate_tp(32, 8, 3)


@pytest.mark.parametrize("kv_heads,tp,heads_per_device", [(8, 2, 4), (8, 8, 1), (2, 8, 1)])
def test_kv_blocks_are_sized_per_device(kv_heads, tp, heads_per_device):
    arch = ArchConfig("LlamaForCausalLM", vocab_size=128, hidden_size=64, num_layers=4,
                      num_heads=32, num_kv_heads=kv_heads, head_dim=128, intermediate_size=64)
    cache = CacheConfig(block_size=16)
    report = kv_cache.plan_num_blocks(arch, cache, "bfloat16", 1024, 0, 0, 8 << 30,
                                      num_devices=tp)
    assert report.per_block == 2 * 4 * heads_per_device * 16 * 128 * 2
    assert mesh_lib.pool_kv_heads(kv_heads, tp) // tp == heads_per_device


def test_measured_block_count_is_stable_across_starts():
    """Peaks a few hundred MB apart (two starts of one config) size the pool alike, so
    the second start finds its compiled steps in the persistent cache; seen on the
    H200: 39964 and 40540 blocks before rounding."""
    arch = ArchConfig("LlamaForCausalLM", vocab_size=128256, hidden_size=4096, num_layers=32,
                      num_heads=32, num_kv_heads=8, head_dim=128, intermediate_size=14336)
    cache = CacheConfig(block_size=16, gpu_memory_utilization=0.9)
    limit, weights = 104 << 30, 15 << 30

    def blocks(peak):
        return kv_cache.plan_num_blocks(arch, cache, "bfloat16", 2048, weights, peak,
                                        limit).num_blocks
    assert blocks(weights + (1 << 30)) == blocks(weights + (1 << 30) + (600 << 20))
    exact = (int(limit * 0.9) - weights - (1 << 30)) // (2 << 20)
    assert exact * 31 // 32 <= blocks(weights + (1 << 30)) <= exact
