"""Pallas (Triton backend) kernels for paged attention, each beside its plain-jnp
reference twin `ref_<kernel>` with the same signature.

KV pool layout, per layer: ``k_cache, v_cache: [Hkv, NB, BS, D]`` (KV heads, blocks,
tokens per block, head dim). A token's slot is ``block_id * BS + offset``. Block 0 is
the null block: padding points there and the scheduler never hands it out.
"""
