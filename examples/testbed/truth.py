"""--ground-truth FILE: JSONL written by both processes.

Every line is one JSON object written with a single ``os.write`` on a file descriptor opened with
``O_APPEND``, so the API server and the engine can append to the same file without interleaving
(on Linux an O_APPEND write moves the offset and writes atomically with respect to other appenders
on a local filesystem). All times are CLOCK_MONOTONIC nanoseconds (``time.monotonic_ns()``), the
clock of ``bpf_ktime_get_ns()``. Line types are documented in examples/README.md.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Optional


class TruthWriter:
    def __init__(self, path: Optional[str]):
        self.path = path
        self._fd: Optional[int] = None
        self._lock = threading.Lock()
        if path:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @property
    def enabled(self) -> bool:
        return self._fd is not None

    def write(self, obj: dict[str, Any]) -> None:
        if self._fd is None:
            return
        line = (json.dumps(obj, separators=(",", ":"), default=_default) + "\n").encode()
        with self._lock:
            os.write(self._fd, line)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _default(o: Any) -> Any:
    if isinstance(o, (set, tuple)):
        return list(o)
    if hasattr(o, "item"):
        return o.item()
    return str(o)


def read_truth(path: str) -> list[dict[str, Any]]:
    out = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out
