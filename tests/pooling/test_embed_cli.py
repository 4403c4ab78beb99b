"""`jaxllm embed`: text or JSONL lines in, .npy or JSONL out, against
sentence-transformers; a run cut short resumes after the rows it wrote; bad input
is one line and exit 2."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from embed_models import texts

from jaxllm.entrypoints.cli import main

MIN_COS = 0.99999
FLAGS = ["--dtype", "float32", "--max-num-batched-tokens", "256", "--disable-tqdm",
         "--compilation-cache-dir", "none"]


def cosines(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return (a * b).sum(1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def st_vectors(folder, inputs):
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(folder, device="cpu").encode(inputs, batch_size=6,
                                                           convert_to_numpy=True)


def run(folder, *args) -> int:
    return main(["embed", folder, *args, *FLAGS])


def fail_line(capsys, folder, *args) -> str:
    with pytest.raises(SystemExit) as e:
        run(folder, *args)
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("jaxllm embed: error: ")
    return err[-1]


def test_text_lines_to_npy(embed_model, tmp_path):
    folder = embed_model("bert")
    lines = texts(17, seed=31, max_words=12)
    lines[5] = ""                                # a blank line keeps its row
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    assert run(folder, "--input", str(src), "--output", str(out)) == 0
    got = np.load(out)
    assert got.shape == (17, 64) and got.dtype == np.float32
    assert cosines(got, st_vectors(folder, lines)).min() >= MIN_COS
    assert not os.path.exists(str(out) + ".progress")


def test_jsonl_in_jsonl_out(embed_model, tmp_path):
    folder = embed_model("qwen3")
    lines = texts(9, seed=32, max_words=12)
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(folder)(lines[2]).input_ids
    records = [lines[0], {"text": lines[1]}, {"prompt_token_ids": ids}] + [
        {"input": t} for t in lines[3:]]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in records))
    out = tmp_path / "out.jsonl"
    assert run(folder, "--input", str(src), "--output", str(out)) == 0
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(9))
    assert cosines([r["embedding"] for r in rows], st_vectors(folder, lines)).min() >= MIN_COS


def test_jsonl_output_resumes_after_its_complete_lines(embed_model, tmp_path):
    folder = embed_model("bert")
    lines = texts(11, seed=33, max_words=8)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    whole = tmp_path / "whole.jsonl"
    assert run(folder, "--input", str(src), "--output", str(whole)) == 0
    expected = whole.read_text().splitlines()
    # A run stopped after 4 lines and half of the 5th; the 4 carry a marker vector,
    # so recomputing them would show.
    part = tmp_path / "part.jsonl"
    marked = [json.dumps({"index": i, "embedding": [7.0]}) for i in range(4)]
    part.write_text("\n".join(marked) + "\n" + expected[4][:20])
    assert run(folder, "--input", str(src), "--output", str(part), "--chunk-size", "3") == 0
    resumed = part.read_text().splitlines()
    assert resumed[:4] == marked and len(resumed) == 11
    got = np.array([json.loads(x)["embedding"] for x in resumed[4:]])
    want = np.array([json.loads(x)["embedding"] for x in expected[4:]])
    np.testing.assert_allclose(got, want, atol=1e-6)


def test_npy_output_resumes_after_the_rows_done(embed_model, tmp_path):
    folder = embed_model("bert")
    lines = texts(10, seed=34, max_words=8)
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "out.npy"
    assert run(folder, "--input", str(src), "--output", str(out)) == 0
    full = np.load(out)
    cut = np.lib.format.open_memmap(out, mode="r+")
    cut[:6], cut[6:] = 7.0, 0.0                   # 6 rows done (marked), the rest not
    cut.flush()
    del cut
    (tmp_path / "out.npy.progress").write_text("6")
    assert run(folder, "--input", str(src), "--output", str(out), "--chunk-size", "3") == 0
    got = np.load(out)
    assert np.all(got[:6] == 7.0)
    np.testing.assert_allclose(got[6:], full[6:], atol=1e-6)
    assert not os.path.exists(str(out) + ".progress")
    # Finished: a third run has nothing left to do and leaves the file alone.
    assert run(folder, "--input", str(src), "--output", str(out)) == 0
    assert np.all(np.load(out)[:6] == 7.0)


def test_bad_input_is_one_line(embed_model, tmp_path, capsys):
    folder = embed_model("bert")
    src = tmp_path / "in.txt"
    src.write_text("a dog\n" + "fox " * 300 + "\n")
    line = fail_line(capsys, folder, "--input", str(src), "--output", str(tmp_path / "o.npy"))
    assert "line[2]" in line and "maximum context length is 128" in line
    line = fail_line(capsys, folder, "--input", str(src), "--output", str(tmp_path / "o.csv"))
    assert "output=" in line and ".npy or .jsonl" in line
    line = fail_line(capsys, folder, "--input", str(src), "--output", str(tmp_path / "p.npy"),
                     "--dimensions", "16")
    assert "does not support matryoshka" in line
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"ok"\n{"prompt": 3}\n')
    line = fail_line(capsys, folder, "--input", str(bad), "--output", str(tmp_path / "q.npy"))
    assert "bad.jsonl:2" in line


def test_generate_on_an_embedding_model_is_one_line(embed_model, capsys):
    with pytest.raises(SystemExit) as e:
        main(["generate", embed_model("bert"), "--prompt", "hi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert "runner=pooling" in err and "jaxllm embed" in err
