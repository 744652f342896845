"""``python -m testbed.serve --port 8000 [--ground-truth FILE] [engine knobs…]`` (with examples/ on
PYTHONPATH, or ``python examples/serve.py …``).

Process layout, as ``vllm serve`` (V1): this process is the API server (uvicorn, one worker); it
binds the engine IPC sockets under ``--ipc-dir`` (default: a fresh directory under $TMPDIR, like
``VLLM_RPC_BASE_PATH``), spawns the EngineCore process (multiprocessing 'spawn'), waits for the
engine's ready message, then serves HTTP. SIGINT/SIGTERM stop both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import sys
import tempfile
import time

from .api_server import AsyncEngineClient, _install_timed_protocol, build_app
from .config import add_engine_args, engine_config_from_args
from .truth import TruthWriter


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="testbed.serve", description="vLLM-shaped testbed server for hopscope")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 = pick a free port (see --port-file)")
    p.add_argument("--port-file", default=None, help="write the bound port here once serving")
    p.add_argument("--ipc-dir", default=None, help="directory for the ipc:// sockets")
    p.add_argument("--ipc-names", default=None, metavar="IN,OUT",
                   help="file names of the input/output ipc sockets (default: two uuid4s, as vLLM)")
    p.add_argument("--engine-ipc-dir", default=None,
                   help="make the engine connect to sockets in this directory instead of --ipc-dir "
                        "(for a byte-capturing relay in between)")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="echo X-Request-Id in responses (as vLLM's flag)")
    p.add_argument("--disable-prompt-tokens-details", dest="prompt_tokens_details", action="store_false",
                   help="omit usage.prompt_tokens_details.cached_tokens")
    p.add_argument("--forward-trace-headers", action="store_true",
                   help="copy traceparent/tracestate into EngineCoreRequest.trace_headers")
    p.add_argument("--log-level", default="warning")
    add_engine_args(p)
    return p


def _server_class():
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn re-raises SIGINT/SIGTERM after a graceful shutdown; we stop the engine and exit 0
        instead, so signal handling is ours."""

        @contextlib.contextmanager
        def capture_signals(self):
            yield

        def request_exit(self) -> None:
            if self.should_exit:
                self.force_exit = True
            self.should_exit = True

    return _Server


async def _serve(args: argparse.Namespace) -> None:
    import uvicorn

    _Server = _server_class()

    cfg = engine_config_from_args(args)
    own_ipc = args.ipc_dir is None
    ipc_dir = args.ipc_dir or tempfile.mkdtemp(prefix="testbed-ipc-")
    os.makedirs(ipc_dir, exist_ok=True)
    truth = TruthWriter(cfg.ground_truth)
    truth.write({"type": "frontend_start", "pid": os.getpid(), "ns": time.monotonic_ns()})

    # Bind the HTTP socket first (as vLLM does) so the port is ours before the engine starts.
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((args.host, args.port))
    sock.set_inheritable(True)
    port = sock.getsockname()[1]

    names = tuple(args.ipc_names.split(",", 1)) if args.ipc_names else None
    client = AsyncEngineClient(cfg, ipc_dir, names, args.engine_ipc_dir)  # type: ignore[arg-type]
    try:
        await client.start()
        app = build_app(client, cfg, truth, args.enable_request_id_headers, args.prompt_tokens_details,
                        args.forward_trace_headers)
        loop_impl = "uvloop" if importlib.util.find_spec("uvloop") else "asyncio"
        config = uvicorn.Config(app, http=_install_timed_protocol(), loop=loop_impl, log_level=args.log_level,
                                access_log=False, timeout_keep_alive=30, lifespan="off")
        server = _Server(config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, server.request_exit)

        async def announce() -> None:
            while not server.started:
                await asyncio.sleep(0.02)
            print(f"testbed: serving {cfg.model_name} on http://{args.host}:{port} "
                  f"(api pid {os.getpid()}, engine pid {', '.join(str(p.pid) for p in client.procs)}, device {cfg.device})",
                  file=sys.stderr, flush=True)
            if args.port_file:
                tmp = args.port_file + ".tmp"
                with open(tmp, "w") as f:
                    f.write(f"{port}\n")
                os.replace(tmp, args.port_file)

        ann = asyncio.create_task(announce())
        await server.serve(sockets=[sock])
        ann.cancel()
    finally:
        await client.shutdown()
        truth.write({"type": "frontend_stop", "pid": os.getpid(), "ns": time.monotonic_ns()})
        truth.close()
        if own_ipc:
            shutil.rmtree(ipc_dir, ignore_errors=True)


def main(argv=None) -> None:
    args = make_parser().parse_args(argv)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None and hasattr(uvloop, "run"):
        uvloop.run(_serve(args))  # as vLLM's API server
    else:
        asyncio.run(_serve(args))


if __name__ == "__main__":
    main()
