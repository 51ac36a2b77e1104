"""The soak (bench/soak.py) at smaller scale: 8 clients, 20 requests over 5 questions, real SmolLM2 (slow).

A live `tandem serve` subprocess; 20% of clients hang up mid-stream, 10% send invalid
bodies, the rest stream greedy completions of mixed lengths. Nothing is lost or
truncated, every completed greedy text equals its solo reference, no 5xx, no rows left,
RSS back within 10% of its post-warm-up value, thread count back to its warm value.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))

import soak

pytestmark = pytest.mark.slow


def test_soak_small(real_model):
    real_model("smollm2-135m", "float32")  # fetched and prepared before the server starts
    result = soak.run("smollm2-135m", clients=8, requests=14, seed=3, request_timeout=240,
                      questions=3)
    print(soak.table(result))
    assert result["lost"] == result["truncated"] == result["mismatched"] == 0, result["details"]
    assert result["greedy"] > 8 and result["disconnected"] > 0 and result["refused_400"] > 0
    assert result["http_5xx"] == 0 and result["rows_left"] == 0
    assert abs(result["rss_end_mb"] - result["rss_warm_mb"]) <= 0.1 * result["rss_warm_mb"]
    assert result["threads_end"] == result["threads_warm"]
    assert result["passed"]
