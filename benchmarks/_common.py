"""What every benchmark script shares: best-of-N wall time and an atomic JSON write."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from typing import Any

import jax


def best_time_s(fn: Callable[[], Any], repeats: int) -> float:
    """Best wall time, in seconds, of ``repeats`` calls of ``fn`` (blocking on JAX results)."""
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return best


def write_json(path: str, doc: Any) -> None:
    """Write ``doc`` to ``path`` whole or not at all (temp file, then rename)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2)
    os.replace(tmp, path)
