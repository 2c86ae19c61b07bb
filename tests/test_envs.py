"""Every MINIVLLM_* environment variable is declared, with its meaning, in minivllm/envs.py,
and read only through it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
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


@pytest.mark.parametrize("user", [{}, {"OMP_WAIT_POLICY": "passive"}, {"GOMP_SPINCOUNT": "7"}])
def test_the_command_lines_shorten_openmp_spins_unless_the_user_chose(monkeypatch, user):
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in user.items():
        monkeypatch.setenv(name, value)
    envs.default_openmp_waits()
    expected = user.get("GOMP_SPINCOUNT", None if user else envs.OPENMP_SPIN_TURNS)
    assert os.environ.get("GOMP_SPINCOUNT") == expected
    assert os.environ.get("OMP_WAIT_POLICY") == user.get("OMP_WAIT_POLICY")


@pytest.mark.parametrize("module", ["minivllm.cli", "minivllm.tui.cli"])
def test_the_command_lines_set_the_spins_before_torch_loads(tmp_path, module):
    # OpenMP reads the variable once, as torch loads it: each command line sets it first.
    code = (f"import os, sys; from {module} import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print('torch' in sys.modules, os.environ.get('GOMP_SPINCOUNT'))")
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         cwd=tmp_path, check=True)
    assert out.stdout.split()[-2:] == ["False", envs.OPENMP_SPIN_TURNS]
