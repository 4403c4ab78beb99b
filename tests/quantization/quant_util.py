"""Quantized tiny checkpoints for the tests, and their float oracles.

Writers: `write_compressed_tensors` packs a tiny random HF model with the
compressed-tensors package itself (its presets, `apply_quantization_config`, and
`ModelCompressor.compress_model` + `update_config`; scales computed here with its
own `calculate_qparams`, static input scales from a calibration run);
`write_native_fp8` writes the layout of the official Qwen3-*-FP8 releases by hand
(e4m3 weights, `weight_scale_inv` per 128x128 block, `quant_method: fp8`), or
AutoFP8's (per-tensor `weight_scale` and static `input_scale`);
GPTQ, AWQ and compressed-tensors pack-quantized checkpoints: int_checkpoints.py.

Oracle: `dequantized_hf` reads the written safetensors back with torch, dequantizes
every quantized weight into a float32 HF model and hooks every quantized Linear so its
input is quantized and dequantized per token (or per tensor with the stored scale,
or per 128-group) exactly as jaxllm computes it (vLLM's scales: amax / 448 for fp8,
amax / 127 for int8).
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil

import jax
import numpy as np
import pytest
import torch

FP8 = torch.float8_e4m3fn
TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def shared():
    """tests/conftest.py's builders, imported by path ('conftest' is ambiguous)."""
    spec = importlib.util.spec_from_file_location("_tests_conftest_q",
                                                  os.path.join(TESTS, "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_model(folder: str, arch: str, seed: int = 0, **overrides):
    """A tiny random float32 HF model like conftest's make_tiny_model, with config
    overrides (block FP8 needs widths that are multiples of 128). Not saved."""
    import transformers as tf
    make_hf_config = shared().make_hf_config
    cfg = make_hf_config(arch, **overrides)
    if getattr(cfg, "layer_types", None):           # Qwen3 lists one entry per layer
        cfg.layer_types = cfg.layer_types[:cfg.num_hidden_layers]
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.15)
            else:
                p.uniform_(0.8, 1.2)
    return model


# Every projection's rows and columns whole 128-blocks (block FP8).
BLOCK_SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                    num_key_value_heads=2, head_dim=64)


def calibration_ids(vocab: int, seed: int = 5):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (4, 24), generator=g)


def write_compressed_tensors(folder: str, hf, preset: str) -> None:
    """hf: a float32 HF model (modified in place: quantized and compressed).
    preset: a compressed-tensors preset (FP8, FP8_DYNAMIC, INT8_W8A8, W8A16...), or
    W8A8_AZP: W8A8 with asymmetric (zero-pointed) dynamic per-token activations."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, QuantizationStatus,
                                                 apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    build_tokenizer = shared().build_tokenizer
    static_amax = _calibrate(hf)
    scheme = preset_name_to_scheme(preset.replace("_AZP", ""), ["Linear"])
    if preset.endswith("_AZP"):
        scheme.input_activations.symmetric = False
    apply_quantization_config(hf, QuantizationConfig(config_groups={"group_0": scheme},
                                                     ignore=["lm_head"]))
    for name, m in hf.named_modules():
        if not hasattr(m, "weight_scale"):
            continue
        args = m.quantization_scheme.weights
        w = m.weight.data
        if args.strategy == "channel":
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        elif args.strategy == "group":
            g = w.reshape(w.shape[0], -1, args.group_size)
            lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        elif args.strategy == "block":
            bn, bk = args.block_structure
            blocks = w.reshape(-(-w.shape[0] // bn), -1, w.shape[1] // bk, bk) \
                if w.shape[0] % bn == 0 else None
            assert blocks is not None, "tests use whole row blocks for compressed-tensors"
            lo, hi = blocks.amin(dim=(1, 3)), blocks.amax(dim=(1, 3))
        else:
            lo, hi = w.amin(), w.amax()
        s, zp = calculate_qparams(lo, hi, args)
        m.weight_scale.data.copy_(s.reshape(m.weight_scale.shape))
        if hasattr(m, "weight_zero_point"):
            m.weight_zero_point.data.copy_(zp.reshape(m.weight_zero_point.shape))
        if hasattr(m, "input_scale"):
            amax = static_amax[name]
            s, _ = calculate_qparams(-amax, amax, m.quantization_scheme.input_activations)
            m.input_scale.data.copy_(s.reshape(m.input_scale.shape))
        m.quantization_status = QuantizationStatus.FROZEN
    compressor = ModelCompressor.from_pretrained_model(hf)
    compressor.compress_model(hf)
    hf.save_pretrained(folder)
    compressor.update_config(folder)
    build_tokenizer(folder)


def _calibrate(hf) -> dict:
    """Largest |input| of every Linear over a few random prompts (static scales)."""
    amax, hooks = {}, []
    for name, m in hf.named_modules():
        if isinstance(m, torch.nn.Linear):
            def hook(mod, args, name=name):
                amax[name] = max(amax.get(name, torch.tensor(0.0)), args[0].abs().max())
            hooks.append(m.register_forward_pre_hook(hook))
    with torch.no_grad():
        hf(calibration_ids(hf.config.vocab_size))
    for h in hooks:
        h.remove()
    return amax


def write_native_fp8(folder: str, hf, block=(128, 128), skip=()) -> None:
    """The Qwen3-*-FP8 layout by hand: every projection's weight in e4m3 with one
    scale per block (weight_scale_inv = amax / 448, the dequantization multiplier),
    lm_head, embeddings and norms in float. block=None: AutoFP8's static layout, one
    weight_scale per tensor (amax / 448) and a static input_scale (the input's largest
    |value| over calibration_ids / 448), `ignored_layers`. Modules whose name contains
    an entry of `skip` stay float and are listed as not converted."""
    from safetensors.torch import save_file
    build_tokenizer = shared().build_tokenizer
    input_amax = _calibrate(hf) if block is None else {}
    tensors = {}
    for name, p in hf.state_dict().items():
        module = name[:-len(".weight")]
        if not name.endswith("_proj.weight") or any(s in module for s in skip):
            tensors[name] = p.detach().contiguous()
        elif block is None:
            s = p.abs().max() / 448.0
            tensors[name] = (p / s).clamp(-448, 448).to(FP8)
            tensors[module + ".weight_scale"] = s.float().reshape(())
            tensors[module + ".input_scale"] = (input_amax[module] / 448.0).float().reshape(())
        else:
            bn, bk = block
            n, k = p.shape
            blocks = p.reshape(-(-n // bn), bn, k // bk, bk)   # tests use whole blocks
            s = blocks.abs().amax(dim=(1, 3)) / 448.0
            q = (blocks / s[:, None, :, None]).clamp(-448, 448).to(FP8).reshape(n, k)
            tensors[name] = q
            tensors[module + ".weight_scale_inv"] = s.float()
    hf.config.save_pretrained(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    if block is None:
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static",
                                      "ignored_layers": ["lm_head", *skip]}
    else:
        cfg["quantization_config"] = {"activation_scheme": "dynamic", "fmt": "e4m3",
                                      "quant_method": "fp8", "weight_block_size": list(block),
                                      "modules_to_not_convert": ["lm_head", *skip]}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    build_tokenizer(folder)


def edited_copy(src: str, dst, edit_config=None, edit_tensors=None) -> str:
    """A copy of the checkpoint folder `src` at `dst`, its config.json dict and its
    model.safetensors tensors (name -> torch tensor) edited in place by the callbacks."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    path = os.path.join(dst, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if edit_config:
        edit_config(cfg)
    with open(path, "w") as f:
        json.dump(cfg, f)
    if edit_tensors:
        st = os.path.join(dst, "model.safetensors")
        tensors = load_file(st)
        edit_tensors(tensors)
        save_file(tensors, st)
    return str(dst)


# ---------------------------------------------------------------- oracle

def _fake_quant(x, kind: str, scale):
    y = x / scale
    if kind == "fp8":
        return y.clamp(-448, 448).to(FP8).float() * scale
    return y.round().clamp(-128, 127) * scale


def act_hook(kind: str, mode: str, static_scale=None, group: int = 128):
    """A forward pre-hook quantizing a Linear's input: mode token | token_asym | tensor
    | group."""
    qmax = 448.0 if kind == "fp8" else 127.0

    def hook(mod, args):
        x = args[0].float()
        if mode == "tensor":
            return (_fake_quant(x, kind, static_scale),)
        if mode == "group":
            g = x.unflatten(-1, (-1, group))
            s = (g.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12)
            return (_fake_quant(g, kind, s).flatten(-2),)
        if mode == "token_asym":      # int8 with a zero point per token (vLLM's azp)
            lo, hi = x.amin(-1, keepdim=True).clamp_max(0), x.amax(-1, keepdim=True).clamp_min(0)
            s = ((hi - lo) / 255).clamp_min(1e-12)
            z = torch.round(-128 - lo / s)
            return ((((x / s).round() + z).clamp(-128, 127) - z) * s,)
        s = (x.abs().amax(-1, keepdim=True) / qmax).clamp_min(1e-12)
        return (_fake_quant(x, kind, s),)
    return hook


def dequantized_hf(folder: str, kind: str, mode: str | None, group: int = 128):
    """A float32 HF model of the checkpoint in `folder` with every quantized weight
    dequantized (weight * scale, per tensor / channel / block) and, unless mode is
    None (weight only), its input quantized in a hook (the quantized Linears only:
    those the checkpoint leaves float keep float inputs). mode: token | tensor | group."""
    import transformers as tf
    from safetensors.torch import load_file
    cfg = tf.AutoConfig.from_pretrained(folder)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    sd = load_file(os.path.join(folder, "model.safetensors"))
    dense, input_scales, quantized = {}, {}, set()
    for name, t in sd.items():
        if name.endswith(("weight_scale", "weight_scale_inv", "weight_zero_point")):
            continue
        if name.endswith(".input_scale"):
            input_scales[name[:-len(".input_scale")]] = t.float().reshape(())
            continue
        base = name[:-len("weight")]
        scale = sd.get(base + "weight_scale", sd.get(base + "weight_scale_inv"))
        if scale is not None and t.dtype in (FP8, torch.int8):
            w = t.float()
            s = scale.float()
            if s.dim() == 2 and s.shape[0] != w.shape[0]:     # blocks
                bn, bk = -(-w.shape[0] // s.shape[0]), w.shape[1] // s.shape[1]
                s = s.repeat_interleave(bn, 0)[:w.shape[0]].repeat_interleave(bk, 1)
            elif s.dim() == 1:
                s = s.reshape(-1, 1) if s.numel() > 1 else s.reshape(1, 1)
            t = w * s
            quantized.add(base[:-1])
        dense[name] = t.float()
    missing, unexpected = model.load_state_dict(dense, strict=False)
    assert not unexpected and all("rotary" in m or "lm_head" in m for m in missing), missing
    if mode is not None:
        for name, m in model.named_modules():
            if name in quantized:
                m.register_forward_pre_hook(act_hook(kind, mode, input_scales.get(name), group))
    return model


def hf_greedy(model, prompts, n: int):
    out = []
    for p in prompts:
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p),
                                 dtype=torch.long), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
        out.append(ref[0, len(p):].tolist())
    return out


def jaxllm_greedy(folder: str, prompts, n: int, **kwargs):
    from jaxllm import LLM, SamplingParams
    llm = LLM(folder, dtype=kwargs.pop("dtype", "float32"), max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, enforce_eager=True, cpu_kv_cache_bytes=8 << 20,
              **kwargs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


def prompts(vocab: int, lens=(5, 17, 40), seed: int = 2):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lens]


def assert_greedy_up_to_ties(model, prompts, outputs, tol: float,
                             max_flips: float = 1 / 8) -> int:
    """Each of our greedy tokens is the HF model's argmax on our own sequence (teacher
    forcing), or within `tol` times the row's logit spread of its top logit (a near-tie
    that a rounding difference may flip); at most `max_flips` of the tokens are such
    flips. fp8 activations make exact equality fragile: a float difference of one ulp
    in a layer's input can move an element across an e4m3 rounding boundary (a step
    of 6-12%), which shifts the logits by more than float rounding would. Returns
    the number of flips."""
    flips = 0
    for p, out in zip(prompts, outputs):
        seq = torch.tensor([p + out])
        with torch.no_grad():
            logits = model(seq).logits[0, len(p) - 1:-1].float()
        for row, tok in zip(logits, out):
            gap = float(row.max() - row[tok]) / float(row.max() - row.min())
            assert gap <= tol, (gap, tok, int(row.argmax()))
            flips += gap > 0
    assert flips <= max(1, int(sum(map(len, outputs)) * max_flips)), flips
    return flips


@pytest.fixture
def no_device_puts(monkeypatch):
    """The jax.device_put calls made while a test runs (a refusal must make none)."""
    calls = []
    real = jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: calls.append(1) or real(*a, **k))
    return calls
