"""Quantized weights and their scales under tensor parallelism: the cases run in a
child process with 8 host devices (tp8_quant_cases.py)."""
from __future__ import annotations

import importlib.util
import os

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)


def _tp_util():
    spec = importlib.util.spec_from_file_location(
        "_tp_util_q", os.path.join(TESTS, "parallel", "tp_util.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quantized_tp_cases_on_8_host_devices():
    tp = _tp_util()
    env = tp.host_devices_env(8)
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(TESTS, "parallel"), HERE,
                                         env["PYTHONPATH"]])
    proc = tp.run_child(["-m", "pytest", "tests/quantization/tp8_quant_cases.py", "-q", "-x",
                         "-p", "no:cacheprovider", "-W", "ignore::DeprecationWarning"],
                        env, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert " passed" in proc.stdout and "skipped" not in proc.stdout, proc.stdout[-2000:]
