"""The scripts in examples/ run as a user runs them (``python examples/NAME.py``, a fresh
process, the default real model) and do what their docstrings say."""
from __future__ import annotations

import ast
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
pytestmark = pytest.mark.model


@pytest.fixture(scope="module", autouse=True)
def default_model_installed():
    """The examples load the default model; skip where it is not installed."""
    from tiercache.models import ModelNotFoundError, default_gguf_path

    try:
        default_gguf_path()
    except ModelNotFoundError as exc:
        pytest.skip(f"default model unavailable: {exc}")


def run_example(name: str) -> str:
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", name)], capture_output=True, text=True,
                          timeout=500, cwd=ROOT)  # within pytest's 600 s
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_long_context_example_answers_and_matches_the_default_cache():
    """A ~3k-token haystack over all three tiers: the answer names the truth, the tokens are
    DynamicCache's, and blocks were moved down to the host and to disk."""
    out = run_example("long_context.py").splitlines()
    qa = next(line for line in out if line.startswith("Q: "))
    answer, truth = qa.split("A: ", 1)[1].rsplit("  (truth ", 1)
    assert truth.rstrip(")") in ast.literal_eval(answer), qa
    assert "same tokens as the default cache: True" in out
    moved = ast.literal_eval(next(line for line in out if line.endswith("bytes moved")).rsplit(" bytes moved", 1)[0])
    assert moved.get("device->host", 0) > 0 and moved.get("host->disk", 0) > 0, moved


def test_wrap_model_example_answers_each_question_with_its_own_cache():
    out = run_example("wrap_model.py").splitlines()
    answers = [line for line in out if " -> " in line]
    assert len(answers) == 2 and all(line.split(" -> ", 1)[1].strip() for line in answers), out
    assert "Paris" in answers[0], answers[0]
    assert sum(line.strip().startswith("stats:") for line in out) == 2
