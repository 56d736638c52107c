"""Running a CLI as a two-process multi-host job (one CPU device each) from the tests."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_two_hosts(cmd: list[str], env: dict, timeout: float) -> tuple[list[int], list[str]]:
    """Run `cmd` as processes 0 and 1 of a --distributed job on a (2, 1) mesh; (exit statuses, stderrs)."""
    flags = ["--mesh", "2,1", "--distributed", "--coordinator", f"localhost:{free_port()}", "--num-processes", "2"]
    xla_flags = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=1".strip()
    hosts = [subprocess.Popen(cmd + flags + ["--process-id", str(i)], cwd=REPO, env={**env, "XLA_FLAGS": xla_flags},
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        errs = [h.communicate(timeout=timeout)[1] for h in hosts]
    finally:
        for h in hosts:
            if h.poll() is None:
                h.kill()
                h.wait()
    return [h.returncode for h in hosts], errs
