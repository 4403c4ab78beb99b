"""A `jaxllm serve` subprocess in tests: its stderr followed on a thread, and the URL
uvicorn prints once the server listens."""
from __future__ import annotations

import queue
import re
import threading
import time


def follow_stderr(proc) -> queue.Queue:
    """The lines of `proc`'s stderr (opened as text), as they come."""
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(x) for x in proc.stderr], daemon=True).start()
    return lines


def wait_for_url(proc, lines: queue.Queue, log: list[str], deadline: float) -> str:
    """The server's URL once uvicorn reports it; the lines read are appended to `log`.
    `deadline` is a time.monotonic() value."""
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            log.append(lines.get(timeout=1))
        except queue.Empty:
            continue
        found = re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", log[-1])
        if found:
            return found.group(1)
    raise AssertionError("jaxllm serve did not come up:\n" + "".join(log[-30:]))
