"""Weight-only integer checkpoints for the tests: `write_gptq_or_awq` writes GPTQ, AWQ
and compressed-tensors pack-quantized layouts by hand (that package's own int32 packer
for the last) from round-to-nearest groups (`rtn_groups`, `pack_words`)."""
from __future__ import annotations

import json
import os

import numpy as np
import torch
from quant_util import shared


def rtn_groups(w: np.ndarray, bits: int, gid: np.ndarray, sym: bool):
    """Round-to-nearest per group of columns (gid[k] = column k's group): unsigned
    q [N, K], f16-rounded scales and zeros [N, G] (as AutoGPTQ and AutoAWQ store)."""
    top = (1 << bits) - 1
    groups = int(gid.max()) + 1
    s = np.zeros((w.shape[0], groups), np.float32)
    z = np.zeros_like(s)
    for j in range(groups):
        cols = w[:, gid == j]
        lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
        if sym:
            s[:, j] = np.maximum(np.abs(lo), hi) / (top // 2)
            z[:, j] = (top + 1) // 2
        else:
            s[:, j] = (hi - lo) / top
            z[:, j] = np.clip(np.round(-lo / s[:, j]), 0, top)
    s = s.astype(np.float16).astype(np.float32)
    q = np.clip(np.round(w / s[:, gid]) + z[:, gid], 0, top).astype(np.uint32)
    return q, s, z


def pack_words(v: np.ndarray, bits: int, axis: int, order=None) -> np.ndarray:
    """Unsigned values -> int32 words, 32 // bits along `axis`, field i holding value
    order[i] of its group (default: in order, low bits first)."""
    per = 32 // bits
    v = np.asarray(v, np.uint32)
    if axis == 0:
        return pack_words(v.T, bits, 1, order).T
    v = v.reshape(v.shape[0], -1, per)
    if order is not None:
        v = v[..., list(order)]
    words = np.zeros(v.shape[:2], np.uint32)
    for i in range(per):
        words |= v[..., i] << np.uint32(bits * i)
    return words.view(np.int32)


def write_gptq_or_awq(folder: str, hf, method: str, bits=4, group=128, desc_act=False,
                      version="gptq", sym=True, skip=(), seed=3):
    """A checkpoint from the published layouts, by hand: GPTQ (qweight packed along K,
    qzeros along N, zeros minus one in v1 "gptq", as stored in v2 "gptq_v2"), AWQ
    GEMM (both along N in the interleaved order 0 2 4 6 1 3 5 7) or, method "pack",
    compressed-tensors pack-quantized (weight_packed [N, K*b/32] along K and, when
    asymmetric, weight_zero_point [N*b/32, G] along N: signed values offset by
    2**(b-1), packed by that package's own pack_to_int32; weight_scale [N, G];
    weight_g_idx with `actorder: group`). desc_act: a random act order (g_idx). AWQ
    modules whose name contains an entry of `skip` stay float (modules_to_not_convert).
    The model `hf` gets the dequantized weights, so it is its own oracle."""
    from safetensors.torch import save_file
    assert not skip or method == "awq", "only AWQ lists modules left float here"
    rng = np.random.default_rng(seed)
    top = (1 << bits) - 1
    tensors, perms = {}, {}
    for name, mod in hf.named_modules():
        if not isinstance(mod, torch.nn.Linear) or name == "lm_head" \
                or any(s in name for s in skip):
            continue
        w = mod.weight.detach().numpy().astype(np.float32)        # [N, K]
        n, k = w.shape
        gid = np.arange(k) // min(group, k) if group > 0 else np.zeros(k, int)
        if desc_act:    # one act order per input (q/k/v share theirs, as GPTQ finds)
            prefix, leaf = name.rsplit(".", 1)
            key = prefix + {"k_proj": ".q_proj", "v_proj": ".q_proj",
                            "up_proj": ".gate_proj"}.get(leaf, "." + leaf)
            perms.setdefault(key, rng.permutation(gid))
            gid = perms[key]
        q, s, z = rtn_groups(w, bits, gid, sym)
        if method == "gptq" and version == "gptq":
            # v1 stores zero - 1 in `bits` bits and vLLM's v1 readers add the 1 back
            # per field, so a zero of 0 would read as 2**bits: the weights are what
            # those readers compute (the tests' random weights have no zero of 0)
            z = (((z.astype(np.int64) - 1) & top) + 1).astype(np.float32)
        mod.weight.data = torch.from_numpy((q.astype(np.float32) - z[:, gid]) * s[:, gid])
        base = name + "."
        if method == "awq":
            order = (0, 2, 4, 6, 1, 3, 5, 7)
            tensors[base + "qweight"] = pack_words(q.T, 4, 1, order)
            tensors[base + "qzeros"] = pack_words(z.T.astype(np.uint32), 4, 1, order)
        elif method == "pack":
            from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

            def signed(v):
                return torch.from_numpy(v.astype(np.int16) - (1 << (bits - 1))).to(torch.int8)
            tensors[base + "weight_packed"] = pack_to_int32(signed(q), bits).numpy()
            tensors[base + "weight_scale"] = s.astype(np.float16)
            tensors[base + "weight_shape"] = np.array([n, k], np.int64)
            if not sym:
                tensors[base + "weight_zero_point"] = pack_to_int32(signed(z), bits,
                                                                    packed_dim=0).numpy()
            if desc_act:
                tensors[base + "weight_g_idx"] = gid.astype(np.int32)
            continue
        else:
            stored_z = (z.astype(np.int64) - (version == "gptq")) & top
            tensors[base + "qweight"] = pack_words(q.T, bits, 0)
            tensors[base + "qzeros"] = pack_words(stored_z.T, bits, 1)
            tensors[base + "g_idx"] = gid.astype(np.int32)
        tensors[base + "scales"] = s.T.astype(np.float16)
    out = {n: torch.from_numpy(np.ascontiguousarray(v)) for n, v in tensors.items()}
    for name, p in hf.state_dict().items():
        if not any(name.startswith(m) for m in {t.rsplit(".", 1)[0] + "." for t in tensors}):
            out[name] = p.detach().contiguous()
    hf.config.save_pretrained(folder)
    save_file(out, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if method == "awq":
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group,
                                      "zero_point": True, "version": "gemm",
                                      "modules_to_not_convert": list(skip) or None}
    elif method == "pack":
        weights = {"num_bits": bits, "type": "int", "symmetric": sym, "dynamic": False,
                   "strategy": "group" if group > 0 else "channel",
                   "group_size": group if group > 0 else None,
                   "actorder": "group" if desc_act else None, "observer": "minmax"}
        cfg["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "pack-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": None,
                                          "output_activations": None,
                                          "format": "pack-quantized"}}}
    else:
        cfg["quantization_config"] = {"quant_method": "gptq", "bits": bits,
                                      "group_size": group, "desc_act": desc_act, "sym": sym,
                                      "checkpoint_format": version, "lm_head": False}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    shared().build_tokenizer(folder)
