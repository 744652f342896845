"""Test helpers: launch the testbed for real, a byte-capturing Unix-socket relay, a ZMTP parser."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import httpx

EXAMPLES = Path(__file__).resolve().parents[1]
# Genuine vLLM 0.34.0 bytes, committed (agent/tests/fixtures/vllm-0.34.0/make.py made them).
FIXTURES_034 = EXAMPLES.parent / "agent" / "tests" / "fixtures" / "vllm-0.34.0"
FIXTURES = EXAMPLES.parent.parent / "shared" / "fixtures" / "vllm-0.33.0"
if not FIXTURES.exists():  # checkout layouts: <root>/main/examples and <root>/shared
    for cand in (EXAMPLES.parent / "shared" / "fixtures" / "vllm-0.33.0",
                 Path("/work/shared/fixtures/vllm-0.33.0")):
        if cand.exists():
            FIXTURES = cand
            break


class Relay:
    """Listens on ``listen_path`` (where the engine connects) and forwards every connection to
    ``target_path`` (the API server's bound socket), recording the bytes of both directions."""

    def __init__(self, listen_path: str, target_path: str):
        self.listen_path = listen_path
        self.target_path = target_path
        self.engine_to_api = bytearray()
        self.api_to_engine = bytearray()
        self.connections = 0
        self._lock = threading.Lock()
        self._srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._srv.bind(listen_path)
        self._srv.listen(4)
        self._stop = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._srv.accept()
            except OSError:
                return
            up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            for _ in range(100):
                try:
                    up.connect(self.target_path)
                    break
                except OSError:
                    time.sleep(0.05)
            self.connections += 1
            threading.Thread(target=self._pump, args=(conn, up, self.engine_to_api), daemon=True).start()
            threading.Thread(target=self._pump, args=(up, conn, self.api_to_engine), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, log: bytearray) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                with self._lock:
                    log.extend(data)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def snapshot(self) -> tuple[bytes, bytes]:
        with self._lock:
            return bytes(self.engine_to_api), bytes(self.api_to_engine)

    def close(self) -> None:
        self._stop = True
        try:
            self._srv.close()
        except OSError:
            pass


# ------------------------------------------------------------------- ZMTP

@dataclass
class ZFrame:
    flags: int
    offset: int
    header_len: int
    body: bytes

    @property
    def more(self) -> bool:
        return bool(self.flags & 1)

    @property
    def long(self) -> bool:
        return bool(self.flags & 2)

    @property
    def command(self) -> bool:
        return bool(self.flags & 4)


@dataclass
class ZStream:
    greeting: bytes
    commands: list[ZFrame] = field(default_factory=list)
    messages: list[list[ZFrame]] = field(default_factory=list)


def parse_zmtp(data: bytes) -> ZStream:
    """Parse one direction of a ZMTP 3.x connection (greeting, commands, multipart messages)."""
    assert len(data) >= 64 and data[0] == 0xFF and data[9] == 0x7F, "not a ZMTP 3 greeting"
    zs = ZStream(greeting=data[:64])
    off = 64
    cur: list[ZFrame] = []
    while off < len(data):
        flags = data[off]
        if flags & 2:
            if off + 9 > len(data):
                break
            size = int.from_bytes(data[off + 1:off + 9], "big")
            hl = 9
        else:
            if off + 2 > len(data):
                break
            size = data[off + 1]
            hl = 2
        if off + hl + size > len(data):
            break  # partial frame at the end of the capture
        fr = ZFrame(flags, off, hl, data[off + hl:off + hl + size])
        off += hl + size
        if fr.command:
            zs.commands.append(fr)
            continue
        cur.append(fr)
        if not fr.more:
            zs.messages.append(cur)
            cur = []
    return zs


def ready_properties(cmd: ZFrame) -> dict[str, bytes]:
    b = cmd.body
    n = b[0]
    assert b[1:1 + n] == b"READY"
    off = 1 + n
    props = {}
    while off < len(b):
        kl = b[off]
        k = b[off + 1:off + 1 + kl].decode()
        off += 1 + kl
        vl = int.from_bytes(b[off:off + 4], "big")
        props[k] = b[off + 4:off + 4 + vl]
        off += 4 + vl
    return props


# ---------------------------------------------------------------- testbed

class Testbed:
    __test__ = False

    def __init__(self, *args: str, relay: bool = False, truth: bool = True, workdir: Optional[str] = None):
        self.args = list(args)
        self.use_relay = relay
        self.workdir = workdir or tempfile.mkdtemp(prefix="tb-")
        self.truth_path = os.path.join(self.workdir, "truth.jsonl") if truth else None
        self.proc: Optional[subprocess.Popen] = None
        self.port: Optional[int] = None
        self.relays: dict[str, Relay] = {}

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 90.0) -> "Testbed":
        # ipc paths must stay under ~100 bytes: keep them in short /tmp dirs
        self.ipc_dir = tempfile.mkdtemp(prefix="tbi-", dir="/tmp")
        cmd = [sys.executable, "-m", "testbed.serve", "--port", "0",
               "--port-file", os.path.join(self.workdir, "port"), "--ipc-dir", self.ipc_dir,
               "--ipc-names", "in.sock,out.sock"]
        if self.use_relay:
            self.engine_dir = tempfile.mkdtemp(prefix="tbr-", dir="/tmp")
            for name in ("in.sock", "out.sock"):
                self.relays[name] = Relay(os.path.join(self.engine_dir, name), os.path.join(self.ipc_dir, name))
            cmd += ["--engine-ipc-dir", self.engine_dir]
        if self.truth_path:
            cmd += ["--ground-truth", self.truth_path]
        cmd += self.args
        env = dict(os.environ)
        env["PYTHONPATH"] = str(EXAMPLES) + os.pathsep + env.get("PYTHONPATH", "")
        env.setdefault("OMP_NUM_THREADS", "1")
        self.log_path = os.path.join(self.workdir, "server.log")
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=str(EXAMPLES))
        port_file = os.path.join(self.workdir, "port")
        deadline = time.monotonic() + timeout
        while not os.path.exists(port_file):
            if self.proc.poll() is not None:
                raise RuntimeError(f"testbed exited early:\n{open(self.log_path).read()}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"testbed did not start:\n{open(self.log_path).read()}")
            time.sleep(0.05)
        self.port = int(open(port_file).read().strip())
        r = httpx.get(self.base_url + "/health", timeout=10)
        assert r.status_code == 200
        return self

    def stop(self) -> int:
        rc = -1
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                rc = self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait(timeout=10)
        elif self.proc is not None:
            rc = self.proc.returncode
        for r in self.relays.values():
            r.close()
        try:
            self._log.close()
        except Exception:
            pass
        shutil.rmtree(self.ipc_dir, ignore_errors=True)
        if self.use_relay:
            shutil.rmtree(self.engine_dir, ignore_errors=True)
        return rc

    def __enter__(self) -> "Testbed":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def run_chains(base_url: str, *args: str, out: Optional[str] = None) -> list[dict]:
    """Run examples/chain_client.py in-process and return its per-hop records."""
    import asyncio
    import importlib.util

    spec = importlib.util.spec_from_file_location("chain_client", EXAMPLES / "chain_client.py")
    mod = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    spec.loader.exec_module(mod)
    argv = ["--base-url", base_url, "--quiet", *args]
    if out:
        argv += ["--out", out]
    return asyncio.run(mod.amain(mod.make_parser().parse_args(argv)))
