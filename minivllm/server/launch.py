"""Start `minivllm serve` as a child process and wait until it answers /health.

Shared by `minivllm bench serve` and the server tests: both need a real server on a free
port of 127.0.0.1, its output in a file, and a clear error with that output when it dies.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (the engine process, its tensor-parallel workers)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def launch_server(argv: list[str], log_path: Path, *, cwd: Path | None = None,
                  timeout: float = 240.0, env: dict[str, str] | None = None
                  ) -> tuple[subprocess.Popen, str]:
    """Run `minivllm serve <argv> --port P`; return the process and its base URL.

    The server's output goes to `log_path`, not a pipe: nobody reads it while the server
    runs, and a full pipe would stall it. The child gets its own session so a test can
    signal it (and its tensor-parallel workers) without touching the caller.
    """
    import httpx

    port = free_port()
    cmd = [sys.executable, "-c", "from minivllm.cli import main; main()", "serve",
           *argv, "--port", str(port)]
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd,
                                start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = Path(log_path).read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the server exited with status {proc.returncode}: {tail}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError(f"the server did not answer /health within {timeout:.0f} s")
