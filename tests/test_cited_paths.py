"""Every file a comment, docstring or doc names exists: in the repository (from its root,
from minivllm/, or from the citing file's folder), or, for a third-party path such as
`textual/cache.py`, in that installed package."""

from __future__ import annotations

import importlib.util
import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Names that look like files but are not: a project's name, a placeholder in an example.
NOT_FILES = {"llama.cpp", "your_script.py",
             "version.py"}  # torch's, which the CLI reads without importing torch
CITED = re.compile(r"(?<![\w/.$~-])((?:[\w-]+/)*[\w-]+\.(?:py|md|cpp|sh|tcss))\b")


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    return out.stdout.split()


def _exists(cited: str, citing: Path, tracked: set[str]) -> bool:
    if "/" not in cited:
        return any(t == cited or t.endswith("/" + cited) for t in tracked)
    for root in (REPO, REPO / "minivllm", citing.parent, citing.parent.parent):
        if (root / cited).is_file():
            return True
    spec = importlib.util.find_spec(cited.split("/")[0])
    return bool(spec and spec.origin and (Path(spec.origin).parent.parent / cited).is_file())


def test_every_cited_file_exists():
    files = _tracked()
    assert files, "run from a git clone: the tracked files are the ones checked"
    tracked = set(files)
    missing = []
    for name in files:
        if not (name.endswith((".py", ".md", ".cpp", ".sh", ".toml")) or name == "Makefile"):
            continue
        path = REPO / name
        if not path.is_file():  # deleted in the working tree
            continue
        for match in CITED.finditer(path.read_text(encoding="utf-8")):
            cited = match.group(1)
            if cited not in NOT_FILES and not _exists(cited, path, tracked):
                missing.append(f"{name}: {cited}")
    assert not missing, "\n".join(missing)
