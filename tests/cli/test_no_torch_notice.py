"""Without torch installed, starting jaxllm prints none of transformers' "PyTorch was
not found" lines (they read like a broken install); transformers itself still prints
it, so the test sees the line when jaxllm's filter is missing. Torch is hidden from
the child process as an uninstalled package looks to importlib."""
from __future__ import annotations

import subprocess
import sys

HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"
LOAD_TOKENIZER = ("from jaxllm.tokenizer import get_tokenizer\n"
                  "tok = get_tokenizer(None)\nassert tok('hello').input_ids\n")


def _stderr(code: str) -> str:
    run = subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True,
                         text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert run.returncode == 0, run.stderr[-2000:]
    return run.stderr


def test_transformers_prints_it_without_jaxllm():
    assert "PyTorch was not found" in _stderr("import transformers\n")


def test_jaxllm_start_prints_no_pytorch_notice():
    err = _stderr("import jaxllm\n" + LOAD_TOKENIZER)
    assert "PyTorch was not found" not in err and "Models won't be available" not in err
