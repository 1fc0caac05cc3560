"""A ``python -m dllm_ops serve`` subprocess on the loopback interface, waited for
with a bound (the tests and ``python -m bench serve --spawn`` use it)."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ServerProcess:
    """``python -m dllm_ops serve --model MODEL --host 127.0.0.1 --port PORT ARGS...``;
    its output goes to a temporary file (:meth:`log`)."""

    def __init__(self, model: str, args: list[str] = (), *, port: int | None = None,
                 ready_timeout: float = 120.0, env: dict | None = None):
        self.host, self.port = "127.0.0.1", port or free_port()
        self.url = f"http://{self.host}:{self.port}"
        self._log = tempfile.TemporaryFile(mode="w+b")
        cmd = [sys.executable, "-m", "dllm_ops", "serve", "--model", model, "--host", self.host,
               "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})
        self.wait_ready(ready_timeout)

    def wait_ready(self, timeout: float) -> None:
        """Until ``GET /health`` answers 200; TimeoutError (with the log) otherwise."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise TimeoutError(f"the server exited with status {self.proc.returncode} before it "
                                   f"was ready:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.2)
        self.kill()
        raise TimeoutError(f"the server was not ready within {timeout:.0f} s:\n{self.log()}")

    def log(self) -> str:
        self._log.flush()
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (the server drains), then its exit status; killed after ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"the server did not exit within {timeout:.0f} s of SIGTERM:\n"
                               f"{self.log()}") from None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        try:
            self.terminate(30)
        finally:
            self.kill()
            self._log.close()
