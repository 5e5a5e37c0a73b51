"""`pagedattn serve` as a child process on a loopback port: started, waited for, stopped with
SIGINT as a terminal's Ctrl-C stops it (the server and, with tensor parallelism, its workers:
the process group). The command-line tests (tests/serve/test_command.py) and
scripts/tp_gpu_check.py start their servers through it.

    with ServeProcess(["--model", folder, "--device", "cpu"]) as server:
        server.wait_ready(60)
        ... openai.OpenAI(base_url=f"{server.url}/v1", ...) ...
    server.returncode  # after SIGINT: 0 when it stopped cleanly
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServeProcess:
    """`python -m pagedattn serve ARGS --port PORT` (a free port unless `args` holds --port), in
    its own session, this interpreter's `sys.path` as its PYTHONPATH. Its output goes to `log`
    (a file object), else a pipe read by `output()`."""

    def __init__(self, args: list[str], *, log=None) -> None:
        args = list(args)
        if "--port" not in args:
            args += ["--port", str(free_port())]
        self.port = int(args[args.index("--port") + 1])
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        self.proc = subprocess.Popen([sys.executable, "-m", "pagedattn", "serve", *args], env=env,
                                     stdout=log if log is not None else subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self.returncode: int | None = None

    def wait_ready(self, timeout_s: float) -> float:
        """Seconds until /health answers 200; AssertionError with its output when the server exits
        first or stays silent for `timeout_s`."""
        start = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"serve exited with {self.proc.returncode} before answering: {self.output()}")
            if time.monotonic() - start > timeout_s:
                raise AssertionError(f"serve did not answer /health within {timeout_s:.0f} s")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return time.monotonic() - start
            except httpx.TransportError:
                pass
            time.sleep(0.2)

    def stop(self, timeout_s: float = 15.0) -> int:
        """SIGINT to the server's process group, then its exit code (SIGKILL after `timeout_s`)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=5)
        self.returncode = self.proc.returncode
        return self.returncode

    def children(self) -> list[int]:
        """Process ids of the server's children now (its tensor-parallel workers, and
        multiprocessing's resource tracker)."""
        kids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    stat = Path(f"/proc/{entry}/stat").read_text()
                    if int(stat.rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                        kids.append(int(entry))
                except (OSError, IndexError, ValueError):
                    continue
        return kids

    def output(self) -> str:
        """What the server printed (its pipe, once it has exited; '' with a log file)."""
        if self.proc.stdout is None or self.proc.poll() is None:
            return ""
        return self.proc.stdout.read()

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
