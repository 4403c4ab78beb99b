"""--generation-config auto|vllm|FOLDER (vLLM's): the model folder's
generation_config.json gives the default sampling parameters. Reading and checking the
file, the start-up log line, and LLM.get_default_sampling_params / generate on a tiny
model folder that carries one (explicit SamplingParams > the file > vLLM's defaults)."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from jaxllm import LLM, SamplingParams
from jaxllm.config import ConfigError, ModelConfig
from jaxllm.generation_config import get_diff_sampling_param

# A creator's recommendations, with keys vLLM does not take and a null one.
FILE = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
        "repetition_penalty": 1.1, "max_new_tokens": 5, "do_sample": True,
        "bos_token_id": 0, "eos_token_id": 1, "typical_p": None}
DEFAULTS = {"temperature": 0.5, "top_p": 0.8, "top_k": 7, "min_p": 0.05,
            "repetition_penalty": 1.1, "max_tokens": 5}
LOG_START = ("Default sampling parameters have been overridden by the model's Hugging Face "
             "generation config recommended from the model creator")
ENGINE = dict(enforce_eager=True, dtype="float32", max_model_len=128, max_num_seqs=4,
              max_num_batched_tokens=64, cpu_kv_cache_bytes=4 << 20)


def folder_with(tmp_path, content, name="gen") -> str:
    folder = tmp_path / name
    folder.mkdir()
    (folder / "generation_config.json").write_text(
        content if isinstance(content, str) else json.dumps(content))
    return str(folder)


@pytest.fixture(scope="module")
def model_folder(tiny_model, tmp_path_factory) -> str:
    """The tiny Llama's files, with FILE as its generation_config.json."""
    folder, _ = tiny_model("llama")
    copy = tmp_path_factory.mktemp("tiny-llama-genconfig") / "model"
    shutil.copytree(folder, copy)
    (copy / "generation_config.json").write_text(json.dumps(FILE))
    return str(copy)


def test_auto_takes_vllms_keys_from_the_model_folder(tmp_path):
    model = folder_with(tmp_path, FILE)
    assert get_diff_sampling_param(ModelConfig(model=model)) == DEFAULTS
    assert get_diff_sampling_param(ModelConfig(model=model, generation_config="vllm")) == {}


def test_a_folder_names_another_file(tmp_path):
    model = folder_with(tmp_path, FILE, "model")
    other = folder_with(tmp_path, {"temperature": 0.25, "max_new_tokens": None}, "other")
    config = ModelConfig(model=model, generation_config=other)
    assert get_diff_sampling_param(config) == {"temperature": 0.25}


def test_no_file_changes_nothing(tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    assert get_diff_sampling_param(ModelConfig(model=str(bare))) == {}
    assert get_diff_sampling_param(ModelConfig(model=None)) == {}      # the embedded GGUF
    assert get_diff_sampling_param(ModelConfig(model=str(tmp_path / "m.gguf"))) == {}
    # bos/eos ids only (what save_pretrained writes for the tiny models): no defaults
    assert get_diff_sampling_param(ModelConfig(model=folder_with(tmp_path, {"bos_token_id": 0}))) \
        == {}


@pytest.mark.parametrize("make, words", [
    (lambda tmp: str(tmp / "missing"), ["not a folder", "--generation-config"]),
    (lambda tmp: str(tmp), ["has no generation_config.json", "--generation-config"]),
    (lambda tmp: folder_with(tmp, "{not json"), ["cannot read", "--generation-config vllm"]),
    (lambda tmp: folder_with(tmp, [1, 2]), ["not a JSON object"]),
    (lambda tmp: folder_with(tmp, {"top_p": 0}), ["top_p", "generation_config.json"]),
    (lambda tmp: folder_with(tmp, {"max_new_tokens": -1}), ["max_tokens"]),
])
def test_a_bad_value_names_the_setting(tmp_path, make, words):
    with pytest.raises(ConfigError) as e:
        get_diff_sampling_param(ModelConfig(generation_config=make(tmp_path)))
    assert all(w in str(e.value) for w in words), e.value
    assert "\n" not in str(e.value)


def test_the_log_line_names_the_defaults(tmp_path, caplog):
    model = folder_with(tmp_path, FILE)
    with caplog.at_level(logging.INFO, logger="jaxllm.generation_config"):
        get_diff_sampling_param(ModelConfig(model=model))
        get_diff_sampling_param(ModelConfig(model=model, generation_config="vllm"))
    (record,) = caplog.records
    line = record.getMessage()
    assert line.startswith(LOG_START) and "--generation-config vllm" in line
    assert all(f"{k}={v}" in line for k, v in DEFAULTS.items()), line


@pytest.fixture(scope="module")
def llm(model_folder):
    return LLM(model_folder, **ENGINE)


def test_llm_defaults_come_from_the_file(llm):
    params = llm.get_default_sampling_params()
    assert {k: getattr(params, k) for k in DEFAULTS} == DEFAULTS
    assert params.presence_penalty == 0.0 and params.n == 1      # not in the file: vLLM's


def test_generate_without_params_uses_them_and_given_params_win(llm, monkeypatch):
    seen = []
    add = llm.llm_engine.add_request
    monkeypatch.setattr(llm.llm_engine, "add_request",
                        lambda rid, prompt, p, **kw: (seen.append(p), add(rid, prompt, p, **kw)))
    (out,) = llm.generate([[5, 6, 7]], use_tqdm=False)
    assert {k: getattr(seen[0], k) for k in DEFAULTS} == DEFAULTS
    assert len(out.outputs[0].token_ids) <= 5
    given = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)
    (out,) = llm.generate([[5, 6, 7]], given, use_tqdm=False)
    assert seen[1].temperature == 0 and seen[1].top_k == 0 and seen[1].max_tokens == 9
    assert len(out.outputs[0].token_ids) == 9
    llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    assert seen[2].max_tokens == 5 and seen[2].top_p == 0.8


def test_vllm_ignores_the_file(model_folder, caplog):
    with caplog.at_level(logging.WARNING, logger="jaxllm.generation_config"):
        llm = LLM(model_folder, generation_config="vllm", **ENGINE)
    assert not caplog.records
    assert llm.get_default_sampling_params() == SamplingParams()


def test_priority_needs_the_priority_policy(llm):
    with pytest.raises(ValueError, match="priority=1 needs priority scheduling"):
        llm.generate(["hello"], use_tqdm=False, priority=[1])
    assert not llm.llm_engine.has_unfinished_requests()
