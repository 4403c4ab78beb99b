"""speculative_config: vLLM's rules, every mistake one ConfigError line naming the key,
and the ways in (LLM kwargs, --speculative-config, config files, pickling)."""
from __future__ import annotations

import json
import pickle

import pytest

from jaxllm.config import (ConfigError, EngineConfig, SpeculativeConfig,
                           engine_config_from_flat, flat_from_config)
from jaxllm.config_file import build_config
from jaxllm.entrypoints.cli import launch_config, main, parse_args
from jaxllm.spec_decode import config as spec_config
from jaxllm.spec_decode.config import check_draft_vocab


def spec(**kv) -> SpeculativeConfig:
    return SpeculativeConfig.from_value(kv)


def test_ngram_lookup_defaults_and_one_bound_copied():
    s = spec(method="ngram", num_speculative_tokens=4)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (5, 5)        # vLLM's default
    s = spec(method="ngram", num_speculative_tokens=4, prompt_lookup_max=3)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (3, 3)
    s = spec(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (2, 2)
    s = spec(method="ngram", num_speculative_tokens=4, prompt_lookup_min=2, prompt_lookup_max=7)
    assert (s.prompt_lookup_min, s.prompt_lookup_max) == (2, 7)


@pytest.mark.parametrize("model, method", [
    ("/m/yuhuili/EAGLE-LLaMA3-Instruct-8B", "eagle"),
    ("/m/yuhuili/EAGLE3-LLaMA3.1-Instruct-8B", "eagle3"),
    ("/m/AngelSlim/Qwen3-8B_eagle3", "eagle3"),
    ("/m/Llama-3.2-1B-Instruct", "draft_model"),
])
def test_method_inferred_from_the_model_as_vllm(model, method):
    s = spec(model=model, num_speculative_tokens=3)
    assert (s.method, s.model) == (method, model)
    assert s.uses_draft_model
    # A method given wins over the name.
    assert spec(model=model, method="draft_model", num_speculative_tokens=3).method == "draft_model"


def test_vllm_ngram_spellings():
    for value in ({"model": "[ngram]"}, {"model": "ngram"}, {"method": "[ngram]"},
                  {"method": "ngram", "model": "[ngram]"}):
        s = SpeculativeConfig.from_value({**value, "num_speculative_tokens": 2})
        assert (s.method, s.model, s.uses_draft_model) == ("ngram", None, False)


def test_disable_by_batch_size_default_is_read_when_used(monkeypatch):
    s = spec(method="ngram", num_speculative_tokens=2)
    assert s.disable_by_batch_size is None
    assert s.effective_disable_by_batch_size == spec_config.DEFAULT_DISABLE_BY_BATCH_SIZE
    monkeypatch.setattr(spec_config, "DEFAULT_DISABLE_BY_BATCH_SIZE", 7)
    assert s.effective_disable_by_batch_size == 7
    assert spec(method="ngram", num_speculative_tokens=2,
                disable_by_batch_size=9).effective_disable_by_batch_size == 9


@pytest.mark.parametrize("value, words", [
    ({"method": "medusa", "num_speculative_tokens": 2},
     ["speculative_config.method='medusa'", "vLLM method jaxllm does not implement",
      "ngram, draft_model, eagle, eagle3"]),
    ({"method": "ngarm", "num_speculative_tokens": 2},
     ["speculative_config.method='ngarm'", "unknown", "ngram, draft_model, eagle, eagle3"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_mx": 3},
     ["unknown key 'prompt_lookup_mx'", "did you mean 'prompt_lookup_max'?"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
     ["speculative_config.draft_tensor_parallel_size", "a vLLM key jaxllm does not take"]),
    ({"method": "ngram", "num_speculative_tokens": 0},
     ["speculative_config.num_speculative_tokens=0", "must be in 1..16"]),
    ({"method": "ngram", "num_speculative_tokens": 17},
     ["speculative_config.num_speculative_tokens=17", "must be in 1..16"]),
    ({"method": "ngram", "num_speculative_tokens": "4"},
     ["speculative_config.num_speculative_tokens='4'", "give a whole number"]),
    ({"method": "ngram", "num_speculative_tokens": True},
     ["speculative_config.num_speculative_tokens=True", "give a whole number"]),
    ({"method": "ngram"}, ["speculative_config.num_speculative_tokens", "required"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
      "prompt_lookup_max": 2},
     ["speculative_config.prompt_lookup_min=4 is above prompt_lookup_max=2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
     ["speculative_config.prompt_lookup_min=0", "must be >= 1"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "/m/draft"},
     ["speculative_config.model='/m/draft'", "method 'ngram' takes no model"]),
    ({"method": "draft_model", "num_speculative_tokens": 2},
     ["speculative_config.model", "method 'draft_model' needs model"]),
    ({"method": "eagle", "num_speculative_tokens": 2},
     ["speculative_config.model", "method 'eagle' needs model", "EAGLE head"]),
    ({"method": "eagle3", "num_speculative_tokens": 2},
     ["speculative_config.model", "method 'eagle3' needs model"]),
    ({"num_speculative_tokens": 2}, ["speculative_config: give method", "or model"]),
    ({"method": "eagle", "model": "/m/h", "num_speculative_tokens": 2, "prompt_lookup_max": 3},
     ["speculative_config.prompt_lookup_max=3", "method 'ngram' only"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 1},
     ["speculative_config.disable_by_batch_size=1", "must be >= 2"]),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": ""},
     ["speculative_config.model=''", "non-empty string"]),
    ('{method: "ngram"}', ["not valid JSON", "give an object such as"]),
    ('[1, 2]', ["speculative_config=[1, 2]", "give a mapping"]),
    (4, ["speculative_config=4", "give a mapping"]),
])
def test_each_mistake_is_one_config_error_line(value, words):
    with pytest.raises(ConfigError) as e:
        SpeculativeConfig.from_value(value)
    message = str(e.value)
    assert "\n" not in message
    for word in words:
        assert word in message, message


def test_from_value_takes_json_dict_instance_and_none():
    s = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3}')
    assert s == spec(method="ngram", num_speculative_tokens=3)
    assert SpeculativeConfig.from_value(s) is s
    assert SpeculativeConfig.from_value(None) is None
    # Dashed keys, as CLI users write them.
    assert SpeculativeConfig.from_value({"method": "ngram", "num-speculative-tokens": 3}) == s


def test_draft_vocab_must_equal_the_targets():
    check_draft_vocab(311, 311, "/m/draft")
    with pytest.raises(ConfigError) as e:
        check_draft_vocab(152064, 151936, "/m/qwen-0.5b")
    message = str(e.value)
    assert "\n" not in message
    for word in ("speculative_config.model='/m/qwen-0.5b'", "151936", "152064",
                 "tokenizer and vocabulary"):
        assert word in message


def test_engine_config_coerces_and_round_trips():
    value = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    config = engine_config_from_flat(speculative_config=value)      # LLM(**kwargs)'s path
    assert config.speculative_config == spec(**value)
    assert EngineConfig(speculative_config=json.dumps(value)) == config
    assert EngineConfig().speculative_config is None
    # LLM(**flat_from_config(config)) (the CLI's make_llm), pickling (the engine
    # process is spawned with the config), repr and hashing.
    assert engine_config_from_flat(**flat_from_config(config)) == config
    assert pickle.loads(pickle.dumps(config)) == config
    assert "SpeculativeConfig(num_speculative_tokens=3" in repr(config)
    hash(config.speculative_config)
    with pytest.raises(ConfigError, match="speculative_config.method='x'"):
        engine_config_from_flat(speculative_config={"method": "x", "num_speculative_tokens": 1})


def test_cli_flag_through_the_launch_path():
    value = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2}'
    args = parse_args(["serve", "--speculative-config", value])
    config, _ = launch_config(args, engine_process=True)     # checks without jax
    assert config.speculative_config == spec(method="ngram", num_speculative_tokens=4,
                                             prompt_lookup_min=2)
    args = parse_args(["serve", "--speculative-config", "none"])
    assert launch_config(args, engine_process=True)[0].speculative_config is None


@pytest.mark.parametrize("value, words", [
    ('{"method": "ngram", "num_speculative_tokens": 40}',
     ["num_speculative_tokens=40", "1..16", "(--speculative-config)"]),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3, '
     '"prompt_lookup_max": 2}', ["prompt_lookup_min=3 is above prompt_lookup_max=2"]),
    ('{"method": "foo", "num_speculative_tokens": 2}',
     ["method='foo'", "ngram, draft_model, eagle, eagle3"]),
    ("{method: ngram}", ["(--speculative-config)", "not valid JSON"]),
])
def test_cli_errors_are_one_line_and_exit_2(capsys, value, words):
    with pytest.raises(SystemExit) as e:
        main(["serve", "--speculative-config", value])
    lines = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("jaxllm serve: error: speculative_config")
    for word in words:
        assert word in lines[0], lines[0]


def test_config_file_key_yaml_and_toml(tmp_path):
    yaml_file = tmp_path / "c.yaml"
    yaml_file.write_text("speculative_config:\n  method: draft_model\n  model: drafts/small\n"
                         "  num_speculative_tokens: 3\n")
    config = build_config(str(yaml_file))
    # The draft's path, like the model's, is read from the file's folder.
    assert config.speculative_config == spec(method="draft_model", num_speculative_tokens=3,
                                             model=str(tmp_path / "drafts" / "small"))
    toml_file = tmp_path / "c.toml"
    toml_file.write_text("[speculative_config]\nmethod = \"ngram\"\n"
                         "num_speculative_tokens = 2\nprompt_lookup_max = 3\n")
    assert build_config(str(toml_file)).speculative_config == spec(
        method="ngram", num_speculative_tokens=2, prompt_lookup_max=3)
    # A flag overrides the file's value.
    flags = {"speculative_config": '{"method": "ngram", "num_speculative_tokens": 5}'}
    assert build_config(str(toml_file), flags).speculative_config.num_speculative_tokens == 5
    bad = tmp_path / "bad.yaml"
    bad.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokenz: 3\n")
    with pytest.raises(ConfigError) as e:
        build_config(str(bad))
    assert "unknown key 'num_speculative_tokenz'" in str(e.value)
    assert str(bad) in str(e.value) and "did you mean 'num_speculative_tokens'?" in str(e.value)


def test_speculation_across_processes_is_refused_in_one_line():
    from jaxllm.config import ConfigError, engine_config_from_flat
    with pytest.raises(ConfigError, match="several processes") as e:
        engine_config_from_flat(num_processes=2, process_id=0, coordinator_address="h:1",
                                speculative_config={"method": "ngram",
                                                    "num_speculative_tokens": 2})
    assert "\n" not in str(e.value)


def test_speculation_runs_with_the_decode_kernel_writing_the_kv(monkeypatch):
    """Allowed: verify steps (k + 1 one-token rows of a request) write apart
    (input_batch.decode_rows_independent), and so does the EAGLE head
    (spec_decode/eagle.py); tests/models/test_model_parity.py runs it end to end."""
    for value in (None, "1"):           # the default, and set
        if value is None:
            monkeypatch.delenv("JAXLLM_DECODE_KV_WRITE", raising=False)
        else:
            monkeypatch.setenv("JAXLLM_DECODE_KV_WRITE", value)
        assert EngineConfig(speculative_config={"method": "ngram",
                                                "num_speculative_tokens": 2})
