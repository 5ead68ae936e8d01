"""A sim replica serving the OpenAI API, as a test process (stands in for `vllm serve`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from tests.helpers import MODEL, MetricsSnapshot, free_port, poll

__all__ = ["SimOpenAI"]


class SimOpenAI:
    """A ``python -m replicas --engine sim --openai`` process."""

    def __init__(self, workdir: Path, sim: dict[str, Any] | None = None, *, token_ids: bool = True,
                 api_key: str = "") -> None:
        self.config = {"model": MODEL, "seed": 0, **(sim or {})}
        self.token_ids = token_ids
        self.api_key = api_key
        self.log_path = Path(workdir) / f"sim-openai-{id(self)}.log"
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, port: int | None = None) -> SimOpenAI:
        for attempt in range(3):
            self.port = port or free_port()
            env = dict(os.environ, FAIRSTREAM_REPLICA_SECRET=self.api_key, PYTHONUNBUFFERED="1")
            cmd = [sys.executable, "-m", "replicas", "--engine", "sim", "--openai", f"127.0.0.1:{self.port}",
                   "--config-json", json.dumps(self.config)]
            if not self.token_ids:
                cmd.append("--no-token-ids")
            with open(self.log_path, "ab") as log:
                self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL)
            try:
                poll(self._healthy, 20, what=f"sim OpenAI server on {self.port}")
                return self
            except AssertionError:
                if port is None and self.proc.poll() is not None and attempt < 2:
                    continue  # lost the race for the free port
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _healthy(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            if "address already in use" in self.log_path.read_text(errors="replace"):
                raise AssertionError("address in use")
            raise AssertionError(f"sim OpenAI server exited:\n{self.log_path.read_text()[-2000:]}")
        try:
            return httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    def metrics(self) -> MetricsSnapshot:
        return MetricsSnapshot(httpx.get(f"http://127.0.0.1:{self.port}/metrics", timeout=5).text)

    def running(self) -> float:
        return self.metrics().value("vllm:num_requests_running")

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
