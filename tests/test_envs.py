"""Every MINIVLLM_* environment variable is declared, with its meaning, in minivllm/envs.py,
and read only through it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from minivllm import envs

REPO = Path(__file__).resolve().parent.parent
PRODUCT = [p for folder in ("minivllm", "tui") for p in (REPO / folder).rglob("*.py")]


def test_every_variable_the_code_names_is_declared_and_every_declared_one_is_used():
    named: set[str] = set()
    for path in PRODUCT:
        if path.name != "envs.py":
            named |= set(re.findall(r"MINIVLLM_[A-Z0-9_]*[A-Z0-9]", path.read_text()))
    assert named <= set(envs.VARIABLES), named - set(envs.VARIABLES)
    assert set(envs.VARIABLES) <= named, set(envs.VARIABLES) - named
    assert all(v.meaning for v in envs.VARIABLES.values())


def test_no_product_module_reads_the_environment_for_them_itself():
    pattern = re.compile(r"(environ\.get|environ\[|getenv)\(?\s*[\"']MINIVLLM_")
    readers = [p.name for p in PRODUCT if p.name != "envs.py" and pattern.search(p.read_text())]
    assert readers == []


def test_unset_is_the_default_and_a_wrong_value_names_the_variable(monkeypatch):
    monkeypatch.delenv("MINIVLLM_CPU_STEP", raising=False)
    assert envs.read("MINIVLLM_CPU_STEP") == "native"
    monkeypatch.setenv("MINIVLLM_CPU_STEP", "compiled")
    assert envs.read("MINIVLLM_CPU_STEP") == "compiled"
    monkeypatch.setenv("MINIVLLM_CPU_STEP", "fast")
    with pytest.raises(ValueError, match="MINIVLLM_CPU_STEP='fast': must be one of native"):
        envs.read("MINIVLLM_CPU_STEP")
    monkeypatch.delenv("MINIVLLM_CACHE", raising=False)
    assert envs.read("MINIVLLM_CACHE") is None
    monkeypatch.setenv("MINIVLLM_CACHE", "/some/where")
    assert envs.read("MINIVLLM_CACHE") == "/some/where"
