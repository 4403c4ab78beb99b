"""Config files and flags: precedence, parsing, types, and the shipped configs."""
import glob
import os

import pytest

from jaxllm.config import ConfigError, EngineConfig
from jaxllm.config_file import build_config, merge_settings, prepare_launch, read_file

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHIPPED = sorted(glob.glob(os.path.join(REPO, "configs", "*.yaml")))


def write(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_precedence_defaults_file_flags(tmp_path):
    path = write(tmp_path, "c.yaml", "max_num_seqs: 32\nblock_size: 32\nswap-space: 2\n")
    defaults = {"max_num_seqs": 8, "port": 9000}
    config = build_config(path, {"max_num_seqs": "64"}, defaults)
    assert config.scheduler.max_num_seqs == 64      # flag beats file beats default
    assert config.cache.block_size == 32            # file beats the dataclass default
    assert config.cache.swap_space == 2.0           # dashed key, int read as float
    assert config.server.port == 9000               # launcher default, nothing above it
    assert config.model.dtype == EngineConfig().model.dtype


def test_flag_none_turns_an_optional_key_off(tmp_path):
    path = write(tmp_path, "c.yaml", "compilation_cache_dir: /tmp/x\nmax_model_len: 512\n")
    config = build_config(path, {"compilation_cache_dir": "none", "max_model_len": "None"})
    assert config.compilation_cache_dir is None and config.model.max_model_len is None


def test_sections_and_toml(tmp_path):
    yaml_path = write(tmp_path, "c.yaml", "cache:\n  block_size: 8\nscheduler:\n"
                                         "  enable-chunked-prefill: false\nmodel: m.gguf\n")
    toml_path = write(tmp_path, "c.toml", 'model = "m.gguf"\n[cache]\nblock_size = 8\n'
                                          "[scheduler]\nenable_chunked_prefill = false\n")
    assert read_file(yaml_path) == read_file(toml_path) == {
        "block_size": 8, "enable_chunked_prefill": False,
        "model": os.path.join(str(tmp_path), "m.gguf")}


def test_relative_paths_are_read_from_the_files_folder(tmp_path):
    (tmp_path / "sub").mkdir()
    path = write(tmp_path / "sub", "c.yaml", "model: ../models/x\ntokenizer: /abs/tok\n")
    settings = read_file(path)
    assert settings["model"] == os.path.join(str(tmp_path), "models", "x")
    assert settings["tokenizer"] == "/abs/tok"


def test_served_model_name_from_file_and_flags(tmp_path):
    path = write(tmp_path, "c.yaml", "served_model_name: [a, b]\n")
    assert build_config(path).model.served_model_name == ("a", "b")
    assert build_config(path, {"served_model_name": ["c"]}).model.served_model_name == ("c",)
    assert build_config(None, {"served_model_name": "d"}).model.served_model_name == ("d",)


@pytest.mark.parametrize("text, words", [
    ("max_num_seq: 12\n", ["unknown key 'max_num_seq'", "12", "did you mean 'max_num_seqs'"]),
    ("cache:\n  max_num_seqs: 4\n", ["unknown key 'cache.max_num_seqs'", "did you mean"]),
    ("max_num_seqs: lots\n", ["max_num_seqs='lots'", "give a whole number"]),
    ("enable_prefix_caching: maybe\n", ["enable_prefix_caching='maybe'", "true or false"]),
    ("block_size: true\n", ["block_size=True", "give a whole number"]),
    ("gpu_memory_utilization: null\n", ["gpu_memory_utilization=None", "a value is required"]),
    ("- a\n- b\n", ["must hold a mapping"]),
    ("max_num_seqs: [\n", ["not valid YAML"]),
])
def test_file_errors_name_key_value_and_fix(tmp_path, text, words):
    path = write(tmp_path, "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        read_file(path)
    message = str(e.value)
    assert "\n" not in message and path in message
    for word in words:
        assert word in message


def test_file_kind_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="use a .yaml, .yml or .toml file"):
        read_file(write(tmp_path, "c.json", "{}"))
    with pytest.raises(ConfigError, match="cannot read it"):
        read_file(str(tmp_path / "missing.yaml"))


def test_flag_values_are_typed_like_the_field():
    settings = merge_settings({}, None, {"gpu_memory_utilization": "0.5",
                                         "enable_prefix_caching": "true", "port": "1234"})
    assert settings == {"gpu_memory_utilization": 0.5, "enable_prefix_caching": True,
                        "port": 1234}
    with pytest.raises(ConfigError, match=r"port='http' \(--port\): give a whole number"):
        merge_settings({}, None, {"port": "http"})


def test_out_of_range_values_name_key_and_value(tmp_path):
    path = write(tmp_path, "c.yaml", "gpu_memory_utilization: 1.5\n")
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization=1.5: must be in \(0, 1\]"):
        build_config(path)


def test_shipped_configs_exist():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {"default.yaml", "offline-throughput.yaml", "online-latency.yaml",
            "qwen3-8b.yaml", "llama-3.1-8b.yaml"} <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_shipped_config_builds_and_passes_the_checks(path):
    # "none": turning the cache on here would point this whole pytest process at it.
    config = build_config(path, {"compilation_cache_dir": "none"})
    assert isinstance(config, EngineConfig)
    arch = prepare_launch(config)       # reads config.json / GGUF metadata only
    assert arch.vocab_size > 0


def test_gpu_configs_point_at_the_published_shapes():
    llama = prepare_launch(build_config(os.path.join(REPO, "configs", "llama-3.1-8b.yaml"),
                                        {"compilation_cache_dir": "none"}))
    assert (llama.vocab_size, llama.hidden_size, llama.num_layers, llama.num_heads,
            llama.num_kv_heads, llama.head_dim, llama.intermediate_size) == (
        128256, 4096, 32, 32, 8, 128, 14336)
    assert llama.rope_theta == 500000 and not llama.tie_word_embeddings
    assert dict(llama.rope_scaling)["factor"] == 8.0
    qwen = prepare_launch(build_config(os.path.join(REPO, "configs", "qwen3-8b.yaml"),
                                       {"compilation_cache_dir": "none"}))
    assert (qwen.vocab_size, qwen.num_layers, qwen.intermediate_size, qwen.qk_norm,
            qwen.max_position_embeddings) == (151936, 36, 12288, True, 40960)


def test_gguf_header_reader_matches_the_loader(tmp_path):
    """The launcher's quick GGUF metadata read gives what GGUFFile gives."""
    import gguf
    import numpy as np
    from jaxllm.models.gguf_header import gguf_hf_config, read_gguf_header
    from jaxllm.models.gguf_loader import GGUFFile
    path = str(tmp_path / "tiny.gguf")
    w = gguf.GGUFWriter(path, "llama")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_feed_forward_length(128)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<s>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_eos_token_id(3)
    w.add_tensor("token_embd.weight", np.zeros((4, 64), np.float32))
    w.add_tensor("output.weight", np.zeros((4, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    meta, names = read_gguf_header(path)
    assert meta["tokenizer.ggml.tokens"] == ["a", "b", "ab", "<s>"]
    assert names == ["token_embd.weight", "output.weight"]
    assert gguf_hf_config(path) == GGUFFile(path).hf_config()


def test_prefix_caching_is_on_by_default_and_a_flag_turns_it_off():
    """vLLM v1's default; `--no-enable-prefix-caching` as vLLM spells the opposite."""
    from jaxllm.entrypoints.cli import LAUNCH_DEFAULTS, parse_args
    from jaxllm.config import FLAT_KEYS
    assert EngineConfig().cache.enable_prefix_caching
    for argv, expected in ((["serve"], True), (["serve", "--no-enable-prefix-caching"], False)):
        args = parse_args(argv)
        flags = {k: v for k, v in vars(args).items() if k in FLAT_KEYS}
        config = build_config(None, flags, LAUNCH_DEFAULTS)
        assert config.cache.enable_prefix_caching is expected
