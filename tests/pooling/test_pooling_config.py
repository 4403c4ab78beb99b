"""The pooling runner's settings: what a folder's sentence-transformers files say,
--runner resolution, the step plan, and the errors of each."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxllm.config import ConfigError, ModelConfig, engine_config_from_flat
from jaxllm.pooling.model_info import read_pooling_info, resolve_runner
from jaxllm.pooling.params import PoolingParams

BERT = {"architectures": ["BertModel"], "model_type": "bert", "vocab_size": 300,
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "intermediate_size": 112, "max_position_embeddings": 512}


def folder(tmp_path, config: dict, modules: list | None = None, files: dict | None = None):
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    if modules is not None:
        (d / "modules.json").write_text(json.dumps(modules))
    for name, body in (files or {}).items():
        os.makedirs(d / os.path.dirname(name), exist_ok=True)
        (d / name).write_text(json.dumps(body))
    return str(d)


def st_modules(*kinds):
    paths = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize",
             "Dense": "2_Dense"}
    return [{"idx": i, "name": str(i), "path": paths[k],
             "type": f"sentence_transformers.models.{k}"}
            for i, k in enumerate(kinds)]


@pytest.mark.parametrize("pool_cfg, want", [
    ({"pooling_mode": "mean"}, "MEAN"),
    ({"pooling_mode": "lasttoken"}, "LAST"),
    ({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False}, "CLS"),
    ({"pooling_mode_lasttoken": True}, "LAST"),
])
def test_pooling_modes_in_both_spellings(tmp_path, pool_cfg, want):
    path = folder(tmp_path, BERT, st_modules("Transformer", "Pooling"),
                  {"1_Pooling/config.json": pool_cfg})
    info = read_pooling_info(path)
    assert (info.pooling_type, info.normalize, info.is_encoder) == (want, False, True)


def test_defaults_and_limits(tmp_path):
    path = folder(tmp_path, {**BERT, "matryoshka_dimensions": [16, 32]},
                  files={"sentence_bert_config.json": {"max_seq_length": 100,
                                                      "do_lower_case": True}})
    info = read_pooling_info(path)
    assert (info.pooling_type, info.normalize) == ("CLS", True)     # vLLM's encoder default
    assert info.context_len == 100 and info.do_lower_case
    assert info.is_matryoshka and info.matryoshka_dimensions == (16, 32)
    xlmr = {**BERT, "architectures": ["XLMRobertaModel"], "model_type": "xlm-roberta",
            "pad_token_id": 1, "max_position_embeddings": 514}
    os.makedirs(tmp_path / "x")
    # RoBERTa's positions start past padding_idx: 514 positions hold 512 tokens.
    assert read_pooling_info(folder(tmp_path / "x", xlmr)).context_len == 512


@pytest.mark.parametrize("modules, files, words", [
    (st_modules("Transformer", "Pooling", "Dense"),
     {"1_Pooling/config.json": {"pooling_mode": "cls"}}, "Dense"),
    (st_modules("Transformer", "Pooling"), {"1_Pooling/config.json": {"pooling_mode": "max"}},
     "'max' is not supported"),
    (st_modules("Transformer", "Pooling"),
     {"1_Pooling/config.json": {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": True}},
     "not supported"),
])
def test_unsupported_pipelines_are_named(tmp_path, modules, files, words):
    path = folder(tmp_path, BERT, modules, files)
    with pytest.raises(ConfigError, match=words):
        read_pooling_info(path)


def test_runner_resolution(tmp_path):
    bert = folder(tmp_path, BERT)
    assert resolve_runner(ModelConfig(model=bert)) == "pooling"
    with pytest.raises(ConfigError, match="runner='generate'.*encoder"):
        resolve_runner(ModelConfig(model=bert, runner="generate"))
    os.makedirs(tmp_path / "q")
    bare = folder(tmp_path / "q", {"architectures": ["Qwen3Model"], "model_type": "qwen3"})
    assert resolve_runner(ModelConfig(model=bare)) == "pooling"
    assert resolve_runner(ModelConfig(model=None)) == "generate"
    with pytest.raises(ConfigError, match="runner='embed'"):
        engine_config_from_flat(runner="embed")


def test_task_spelling_and_wrong_calls(tiny_model, embed_model):
    from jaxllm import LLM, SamplingParams
    from jaxllm.pooling.offline import runner_from_task
    assert runner_from_task("embed") == "pooling"
    with pytest.raises(ConfigError, match="task='classify'"):
        runner_from_task("classify")
    pooled = LLM(embed_model("qwen3"), task="embed", dtype="float32")
    assert pooled.runner_type == "pooling"
    with pytest.raises(ValueError, match="only supported for generative models"):
        pooled.generate("hi", SamplingParams(max_tokens=2))
    gen = LLM(tiny_model("llama")[0], max_model_len=64, enforce_eager=True,
              num_gpu_blocks_override=16)
    with pytest.raises(ValueError, match="only supported for pooling models"):
        gen.embed("hi")


@pytest.mark.parametrize("bad", [dict(truncate_prompt_tokens=0), dict(truncate_prompt_tokens=-2),
                                 dict(dimensions=0), dict(dimensions=True)])
def test_pooling_params_checks(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        PoolingParams(**bad)


def test_plan_covers_every_row_once_within_the_budget():
    from jaxllm.pooling.runner import PoolingRunner, seq_buckets
    runner = PoolingRunner.__new__(PoolingRunner)
    runner.budget, runner.max_rows = 512, 16
    runner.buckets = seq_buckets(300)
    assert runner.buckets[:3] == [4, 8, 12] and runner.buckets[-1] == 300
    lengths = np.random.default_rng(0).integers(1, 301, size=500).astype(np.int32)
    seen, partial = [], 0
    for rows, t, b in runner.plan(lengths):
        assert len(rows) <= b and (b * t <= 512 or b == 1) and b <= 16
        assert t == runner.bucket(int(lengths[rows].max()))         # the tightest bucket
        assert b == runner.rows_for(t) or rows is not None and len(rows) < b
        partial += len(rows) < b
        seen.extend(rows.tolist())
    assert sorted(seen) == list(range(500))
    assert partial <= 1              # at most one step of a shape a full step has not


def test_token_store_gathers_the_rows_as_given():
    from jaxllm.pooling.runner import _TokenStore
    rng = np.random.default_rng(1)
    chunks = [[rng.integers(0, 999, int(n)).tolist() for n in rng.integers(1, 300, size)]
              for size in (300, 500, 7)]          # past the first buffer: it must grow
    store = _TokenStore(807)
    rows = [store.add(c) for c in chunks]
    flat = [t for c in chunks for t in c]
    assert store.size == sum(map(len, flat)) > 1 << 16
    pick = np.concatenate(rows)[[0, 299, 300, 806, 5]]
    block = store.padded(pick, 300)
    for j, r in enumerate(pick.tolist()):
        assert block[j, :len(flat[r])].tolist() == flat[r]
        assert not block[j, len(flat[r]):].any()


def test_budget_below_the_context_is_refused(embed_model):
    from jaxllm import LLM
    with pytest.raises(ConfigError, match="max_num_batched_tokens=64 is below max_model_len=128"):
        LLM(embed_model("bert"), max_num_batched_tokens=64)
    with pytest.raises(ConfigError, match="max_model_len=4096 exceeds the model's 128"):
        LLM(embed_model("bert"), max_model_len=4096)
    with pytest.raises(ConfigError, match="quantization='fp8': the pooling runner"):
        LLM(embed_model("bert"), quantization="fp8")
