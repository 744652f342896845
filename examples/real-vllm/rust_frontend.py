"""vLLM 0.34.0's Rust frontend (``vllm-rs frontend``, from vLLM's own wheel) in front of the
testbed's engine speaking vLLM 0.34.0's engine IPC: a real vLLM HTTP server, tokenizer, chat
template, detokenizer and ZeroMQ client (hyper/axum and the ``zeromq`` crate, not uvicorn and
libzmq) on a machine without a GPU, where vLLM 0.34.0's own engine cannot run.

It starts them as vLLM's ``RustFrontendProcessManager`` does: this process binds the HTTP port and
the two engine sockets (the input ROUTER's and the output PULL's, as Unix listeners), hands their
descriptors to ``vllm-rs frontend`` with the shared arguments as JSON, then starts the engine,
which connects to them and sends its ready response. Runs until SIGINT/SIGTERM, or until either
side exits (then exits non-zero).

    python examples/real-vllm/rust_frontend.py --vllm-rs BIN --model DIR --port 18820 \\
        [--served-model-name tiny] [--max-num-seqs 4] [--ground-truth FILE]

``--model`` is a Hugging Face model folder (tokenizer and chat template; no weights are read: the
testbed's random model answers, with the folder's vocabulary size). ``install.sh`` puts
``vllm-rs`` beside the vLLM environment (``VENV/../vllm-rs-0.34.0/vllm-rs``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from testbed.config import EngineConfig  # noqa: E402
from testbed.launcher import Engines  # noqa: E402
from testbed.model_numpy import ModelConfig  # noqa: E402

MAX_MODEL_LEN = 4096  # the frontend's and the engine's alike


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--vllm-rs", required=True, help="vLLM 0.34.0's vllm-rs binary")
    p.add_argument("--model", required=True, help="Hugging Face model folder (tokenizer, chat template)")
    p.add_argument("--port", type=int, default=18820)
    p.add_argument("--served-model-name", default="tiny")
    p.add_argument("--max-num-seqs", type=int, default=4)
    p.add_argument("--ground-truth", default=None, help="the engine's CLOCK_MONOTONIC truth (JSONL)")
    a = p.parse_args()

    vocab = json.loads((Path(a.model) / "config.json").read_text())["vocab_size"]
    ipc = tempfile.mkdtemp(prefix="hopscope-rsfe-")
    names = ("input", "output")
    http = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    http.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    http.bind(("127.0.0.1", a.port))
    http.listen(512)
    listeners = []
    for n in names:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(f"{ipc}/{n}")
        s.listen(64)
        listeners.append(s)
    fds = [http.fileno()] + [s.fileno() for s in listeners]
    for fd in fds:
        os.set_inheritable(fd, True)
    shared = {"model": a.model, "model_tag": a.model, "served_model_name": [a.served_model_name],
              "max_model_len": MAX_MODEL_LEN, "engine_ready_timeout_secs": 120, "http_timeout_keep_alive": 5}
    cmd = [a.vllm_rs, "frontend", "--listen-fd", str(fds[0]), "--input-listener-fd", str(fds[1]),
           "--output-listener-fd", str(fds[2]), "--engine-count", "1", "--data-parallel-size", "1",
           "--args-json", json.dumps(shared, sort_keys=True)]
    stop = []
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.append(True))
    frontend = subprocess.Popen(cmd, pass_fds=fds, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    for s in [http, *listeners]:
        s.close()  # the frontend holds them now
    engines = None
    rc = 0
    try:
        cfg = EngineConfig(model_name=a.served_model_name, vllm_wire="0.34.0", max_num_seqs=a.max_num_seqs,
                           ground_truth=a.ground_truth, model=ModelConfig(vocab_size=vocab, max_model_len=MAX_MODEL_LEN))
        engines = Engines(cfg, ipc, names)
        engines.start()
        while not stop:
            if frontend.poll() is not None:
                print(f"rust_frontend: vllm-rs exited ({frontend.returncode})", file=sys.stderr)
                rc = 1
                break
            dead = engines.dead()
            if dead:
                print(f"rust_frontend: {', '.join(dead)}", file=sys.stderr)
                rc = 1
                break
            time.sleep(0.1)
    finally:
        frontend.terminate()
        try:
            frontend.wait(timeout=10)
        except subprocess.TimeoutExpired:
            frontend.kill()
        if engines is not None:
            engines.stop()
        for n in names:
            try:
                os.unlink(f"{ipc}/{n}")
            except FileNotFoundError:
                pass
        os.rmdir(ipc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
