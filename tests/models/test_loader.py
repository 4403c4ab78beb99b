"""Checkpoint loading: sharded safetensors, bf16, and clear errors for bad checkpoints."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch

from conftest import make_tiny_model
from jaxllm.models.errors import CheckpointError
from jaxllm.models.loader import load_model
from jaxllm.models.registry import UnsupportedModelError


def _params(loaded):
    from flax import nnx
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(loaded.state)}


def test_multi_shard_folder_loads_same_as_single(tmp_path):
    single, sharded = str(tmp_path / "one"), str(tmp_path / "many")
    make_tiny_model(single, "llama")
    make_tiny_model(sharded, "llama", max_shard_size="100KB")
    assert os.path.isfile(os.path.join(sharded, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(sharded) if f.endswith(".safetensors")]) > 2
    a, b = _params(load_model(single, "float32")), _params(load_model(sharded, "float32"))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])


def test_bf16_checkpoint_loads_as_bf16(tmp_path):
    folder = str(tmp_path / "bf16")
    model = make_tiny_model(folder, "qwen3")
    model.to(torch.bfloat16).save_pretrained(folder)
    loaded = load_model(folder, "auto")
    params = _params(loaded)
    assert all(str(v.dtype) == "bfloat16" for v in params.values())
    want = model.model.embed_tokens.weight.float().detach().numpy()
    np.testing.assert_array_equal(params["embed_tokens"].astype(np.float32), want)


def test_missing_folder_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="no such file or folder"):
        load_model(str(tmp_path / "nope"))
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no config.json"):
        load_model(str(tmp_path / "empty"))


def test_unknown_architecture(tmp_path):
    folder = str(tmp_path / "m")
    make_tiny_model(folder, "llama")
    cfg_path = os.path.join(folder, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["architectures"] = ["GPT2LMHeadModel"]
    json.dump(cfg, open(cfg_path, "w"))
    with pytest.raises(UnsupportedModelError, match="GPT2LMHeadModel.*not supported"):
        load_model(folder)


def test_missing_tensor_names_file_and_tensor(tmp_path):
    from safetensors.numpy import load_file, save_file
    folder = str(tmp_path / "m")
    make_tiny_model(folder, "llama")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"missing tensor model\.layers\.1\.mlp\.up_proj"):
        load_model(folder)


def test_wrong_shape_names_tensor_and_parameter(tmp_path):
    from safetensors.numpy import load_file, save_file
    folder = str(tmp_path / "m")
    make_tiny_model(folder, "llama")
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.0.mlp.down_proj.weight"] = np.zeros((64, 50), np.float32)
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*down_proj.weight has shape "
                                              r"\(64, 50\).*layers\.0\.mlp\.down_proj"):
        load_model(folder)


def test_sharded_index_lists_missing_file(tmp_path):
    folder = str(tmp_path / "m")
    make_tiny_model(folder, "llama", max_shard_size="100KB")
    victim = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(folder, victim))
    with pytest.raises(CheckpointError, match=f"{victim} is listed in the index but missing"):
        load_model(folder)


def test_bad_gguf_file(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"not a gguf file at all")
    with pytest.raises(CheckpointError, match="not a readable GGUF"):
        load_model(str(path))


def test_gguf_tokenizer_from_the_header_is_the_readers():
    """The engine builds the GGUF tokenizer from the header alone (on a thread, while
    the weights load through the `gguf` reader): the same tokenizer as the reader's."""
    from jaxllm.models.gguf_loader import default_model_path, gguf_tokenizer, open_gguf
    path = default_model_path()
    ours, reader = gguf_tokenizer(path), open_gguf(path).tokenizer()
    assert ours.backend_tokenizer.to_str() == reader.backend_tokenizer.to_str()
    assert ours.chat_template == reader.chat_template and ours.chat_template
    assert ours.special_tokens_map == reader.special_tokens_map


def test_load_tokenizer_placeholder_and_chat_template(tmp_path):
    """A --load-format dummy folder with only config.json gets a placeholder of the
    model's vocabulary; --chat-template's file replaces the template."""
    from jaxllm.config import engine_config_from_flat
    from jaxllm.tokenizer import load_tokenizer
    folder = tmp_path / "shape"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "intermediate_size": 128}))
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    config = engine_config_from_flat(model=str(folder), load_format="dummy",
                                     chat_template=str(template))
    tok = load_tokenizer(config.model)
    assert len(tok) == 300 and tok.decode([7, 299]) == "t7 t299"
    assert tok.chat_template == template.read_text()


def test_placeholder_tokenizer_imports_no_torch(tmp_path):
    """A dummy folder's placeholder needs no AutoTokenizer, whose import brings torch
    in where it is installed (seconds of every --load-format dummy start)."""
    import subprocess
    import sys
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 300}))
    code = ("import sys\n"
            "from jaxllm.tokenizer import get_tokenizer\n"
            "assert len(get_tokenizer(sys.argv[1], vocab_size=300)) == 300\n"
            "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "False"


def test_model_checks_before_the_spawn_import_no_jax(tiny_model):
    """`jaxllm serve` checks the model (config.json or GGUF header) before it spawns
    the engine process; importing jax there would hold the spawn up for seconds."""
    import subprocess
    import sys
    folder, _ = tiny_model("llama")
    code = ("import sys\n"
            "from jaxllm.entrypoints.cli import launch_config, parse_args\n"
            "for model in sys.argv[1:]:\n"
            "    launch_config(parse_args(['serve', *model.split()]), engine_process=True)\n"
            "print(sorted(m for m in ('jax', 'flax', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, folder, "", f"{folder} --load-format dummy"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip() == "[]"
