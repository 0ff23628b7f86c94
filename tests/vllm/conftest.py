"""Fixtures of the vLLM backend tests.

vLLM reads its environment when an engine starts, so it is set here, before any test module
builds one: in-process engine, an explicit KV cache, no thread pinning on the shared 2-core machine.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from verl_conformance.testkit import TinyModelSpec, tiny_model

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session")
def llama_path() -> Path:
    """An untied tiny Llama folder."""
    return tiny_model(TinyModelSpec(arch="llama"))


@pytest.fixture(scope="session")
def qwen2_path() -> Path:
    """An untied tiny Qwen2 folder (QKV bias).

    vLLM's Qwen2 derives the head width as hidden_size / num_heads (it ignores ``head_dim``), and
    its CPU attention needs >= 32, so the width is 128 (4 heads of 32).
    """
    return tiny_model(TinyModelSpec(arch="qwen2", hidden_size=128))


@pytest.fixture(scope="session")
def qwen3_tied_path() -> Path:
    """A tied tiny Qwen3 folder (QK norm, lm_head shares the embedding)."""
    return tiny_model(TinyModelSpec(arch="qwen3", tied=True))
