"""Every launch check fails before the model loads: one line naming the key, the
value and the fix, and exit code 2."""
import os
import subprocess
import sys

import pytest

from jaxllm.entrypoints.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# In-process runs must not switch this pytest process's jax onto a compile cache.
NO_CACHE = ["--compilation-cache-dir", "none"]


def run_cli(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main([*argv])
    err = capsys.readouterr().err
    return e.value.code, err


def one_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["serve", "--max-num-seq", "4"], ["unknown argument '--max-num-seq'",
                                       "did you mean --max-num-seqs?"]),
    (["serve", "--max-num-seqs", "abc"], ["max_num_seqs='abc'", "--max-num-seqs",
                                          "give a whole number"]),
    (["serve", "--max-num-seqs", "0"], ["max_num_seqs=0", "must be >= 1"]),
    (["serve", "--gpu-memory-utilization", "1.5"], ["gpu_memory_utilization=1.5",
                                                    "must be in (0, 1]"]),
    (["serve", "--block-size", "12"], ["block_size=12", "use 8, 16 or 32"]),
    (["serve", "--kv-cache-dtype", "int4"], ["kv_cache_dtype='int4'", "choose one of"]),
    (["serve", "--port", "70000"], ["port=70000", "0..65535"]),
    (["serve", "--max-model-len", "100000"], ["max_model_len=100000",
                                              "exceeds the model's context of 8192",
                                              "set max_model_len to 8192 or less"]),
    (["serve", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "1024"],
     ["max_num_batched_tokens=1024", "max_model_len=8192", "chunked prefill off",
      "raise max_num_batched_tokens to 8192"]),
    (["serve", "--tensor-parallel-size", "2"], ["tensor_parallel_size=2",
                                                "9 query heads and 3 KV heads",
                                                "use one of 1, 3, 9"]),
    (["serve", "--tensor-parallel-size", "3"], ["tensor_parallel_size=3",
                                                "asks for 3 devices but 1 is present",
                                                "set tensor_parallel_size to 1 or less"]),
    (["serve", "/no/such/model"], ["model='/no/such/model'", "give an HF model folder"]),
    (["serve", "m1", "--model", "m2"], ["model given twice", "keep one"]),
    (["generate", "--max-tokens", "x"], ["--max-tokens", "invalid int value: 'x'"]),
    (["generate", "--temperature", "-1"], ["temperature", ">= 0"]),
    (["generate"], ["no prompts", "--prompt"]),
    (["bench", "throughput", "--num-prompts", "0"], ["num_prompts=0", "must be >= 1"]),
    (["bench", "serve", "--request-rate", "0"], ["request_rate=0.0", "must be > 0"]),
    (["bench", "latency", "--batch-size", "0"], ["batch_size=0", "must be >= 1"]),
    (["bench", "nonsense"], ["invalid choice: 'nonsense'"]),
])
def test_bad_setting_is_one_line_and_exit_2(capsys, argv, words):
    engine = argv[:2] != ["bench", "serve"] and argv[:2] != ["bench", "nonsense"]
    code, err = run_cli(capsys, *argv, *(NO_CACHE if engine else []))
    line = one_line(err)
    assert code == 2
    for word in words:
        assert word in line, line


def test_config_file_errors_from_the_command_line(capsys, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("max_num_batched_token: 4096\n")
    code, err = run_cli(capsys, "serve", "--config", str(bad), *NO_CACHE)
    line = one_line(err)
    assert code == 2 and str(bad) in line
    assert "unknown key 'max_num_batched_token'" in line and "4096" in line
    assert "did you mean 'max_num_batched_tokens'?" in line


def test_flag_overrides_a_bad_file_value(capsys, tmp_path):
    """Precedence seen from the command line: the file's block size is replaced by the
    flag's before any check runs, so only the flag's bad value is reported."""
    path = tmp_path / "c.yaml"
    path.write_text("block_size: 32\nmax_model_len: 100000\n")
    code, err = run_cli(capsys, "serve", "--config", str(path), "--max-model-len", "9000",
                        *NO_CACHE)
    assert code == 2 and "max_model_len=9000 exceeds" in one_line(err)


def test_device_count_uses_the_devices_present(capsys):
    """More devices than jax sees: checked against len(jax.devices()), not assumed."""
    import jax
    n = len(jax.devices())
    code, err = run_cli(capsys, "serve", "--tensor-parallel-size", "9", *NO_CACHE)
    assert code == 2 and f"asks for 9 devices but {n}" in one_line(err)


def test_real_process_exit_code_and_quick_help():
    """The console entry point as a process: exit code 2, and --help never imports jax."""
    cmd = [sys.executable, "-m", "jaxllm.entrypoints.cli"]
    bad = subprocess.run(cmd + ["serve", "--block-size", "7"], cwd=REPO,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2
    assert bad.stderr.strip() == "jaxllm serve: error: block_size=7: use 8, 16 or 32"
    probe = ("import sys; from jaxllm.entrypoints.cli import main\n"
             "try: main(['serve', '--help'])\n"
             "except SystemExit: pass\n"
             "assert 'jax' not in sys.modules, 'jax imported by --help'")
    out = subprocess.run([sys.executable, "-c", probe], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for flag in ("--gpu-memory-utilization", "--max-model-len", "--block-size",
                 "--max-num-seqs", "--max-num-batched-tokens", "--enable-chunked-prefill",
                 "--enable-prefix-caching", "--kv-cache-dtype", "--swap-space",
                 "--tensor-parallel-size", "--dtype", "--seed", "--served-model-name",
                 "--host", "--port", "--api-key", "--chat-template", "--load-format",
                 "--enforce-eager", "--compilation-cache-dir", "--config"):
        assert flag in out.stdout, flag


def test_prompts_file_errors_name_the_line(capsys, tmp_path):
    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "ok"}\n{"prompt": 3}\n')
    code, err = run_cli(capsys, "generate", "--prompts-file", str(path), *NO_CACHE)
    assert code == 2 and f"{path}:2: give a string" in one_line(err)
    path.write_text('"ok"\nnot json\n')
    code, err = run_cli(capsys, "generate", "--prompts-file", str(path), *NO_CACHE)
    assert code == 2 and f"{path}:2: not JSON" in one_line(err)


def test_prompts_from_flags_text_and_jsonl(tmp_path):
    from jaxllm.entrypoints.cli import read_prompts
    text = tmp_path / "p.txt"
    text.write_text("first\n\n{not json}\n")
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('"a"\n{"prompt": "b"}\n{"prompt_token_ids": [1, 2]}\n')
    assert read_prompts(["x"], str(text)) == ["x", "first", "{not json}"]
    assert read_prompts([], str(jsonl)) == ["a", "b", {"prompt_token_ids": [1, 2]}]
