"""The attention kernels' tile settings stay within the H200's shared memory for every
dtype x head dim (f32, f16, bf16 x 64, 128, 256), and keep the tuned settings where
they already fit. The device refused the ragged kernel's old f32 x head_dim 128
setting: "Shared memory size limit exceeded: requested 294912, available: 232448"."""
from __future__ import annotations

import pytest

from pallas_kernels import common, paged_attention_decode as decode, \
    ragged_paged_attention as ragged

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1}


def test_rule_reproduces_the_refusal():
    assert common.kv_smem_bytes(64, 128, 4, 3) == 294_912 > common.SMEM_BYTES
    assert common.SMEM_BYTES == 232_448


@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", list(DTYPE_BYTES))
def test_settings_fit(dtype, d, bs):
    item = DTYPE_BYTES[dtype]
    dp = common.next_pow2(d)
    block_q, bps, stages = ragged.default_settings(4, dp, bs, item)
    assert common.kv_smem_bytes(bps * bs, dp, item, stages) <= common.SMEM_BYTES
    assert block_q * 4 * dp * 4 <= common.ACC_BYTES and stages >= 2 and bps >= 1
    bps, stages = decode.default_settings(dp, bs, item)
    assert common.kv_smem_bytes(bps * bs, dp, item, stages) <= common.SMEM_BYTES
    assert stages >= 2 and bps >= 1


@pytest.mark.parametrize("item", [1, 2])
def test_tuned_two_byte_settings_unchanged(item):
    """bf16 / fp8 KV at head_dim 128, block 16: the settings the H200 sweeps chose
    (the decode kernel takes 128 keys x 3 stages for fp8 KV)."""
    assert ragged.default_settings(4, 128, 16, item) == (64, 4, 3)
    assert decode.default_settings(128, 16, item) == ((4, 2) if item == 2 else (8, 3))
    assert decode.default_settings(128, 32, 1) == (4, 3)          # 128 keys at block 32
    assert decode.default_settings(256, 16, 1) == (8, 2)          # d256: 2 stages fit


def test_what_shrinks():
    assert ragged.default_settings(4, 128, 16, 4) == (64, 4, 2)     # f32: 2 stages
    assert ragged.default_settings(4, 256, 16, 2) == (32, 4, 2)     # bf16 d256: rows, stages
    assert ragged.default_settings(4, 256, 16, 4) == (32, 2, 2)     # f32 d256: keys too
    assert decode.default_settings(256, 16, 4) == (2, 2)
