"""Fixtures: the tiny embedding models of embed_models.py, built once per session."""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import embed_models  # noqa: E402


@pytest.fixture(scope="session")
def embed_model(tmp_path_factory):
    """embed_model(name) -> folder (see embed_models.py for the names)."""
    cache: dict[str, str] = {}
    recipes = {
        "bert": lambda d: embed_models.make_st_folder(d, "bert", "mean"),
        "xlmr": lambda d: embed_models.make_st_folder(d, "xlmr", "cls"),
        "qwen3": lambda d: embed_models.make_st_folder(d, "qwen3", "lasttoken"),
        "bert_cls_legacy": lambda d: embed_models.make_legacy_cls_folder(d, get("bert")),
        "bert_plain": lambda d: embed_models.make_plain_folder(d, get("bert")),
    }

    def get(name: str) -> str:
        if name not in cache:
            cache[name] = recipes[name](str(tmp_path_factory.mktemp("embed") / name))
        return cache[name]

    return get
