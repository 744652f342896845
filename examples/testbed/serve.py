"""``python -m testbed.serve --port 8000 [--ground-truth FILE] [engine knobs…]`` (with examples/ on
PYTHONPATH, or ``python examples/serve.py …``).

Process layout, as ``vllm serve`` (V1): this process binds the HTTP socket, spawns the EngineCore
process(es) and, when data-parallel, the DP coordinator (multiprocessing 'spawn', launcher.py),
then serves as the API server (uvicorn, one worker): it binds the engine IPC sockets under
``--ipc-dir`` (default: a fresh directory under $TMPDIR, like ``VLLM_RPC_BASE_PATH``), waits for
the engines' ready messages, then serves HTTP. With ``--api-server-count N`` > 1 (vLLM's
``run_multi_api_server``) it serves no HTTP itself: it spawns N API server processes
(``APIServer_<i>``), each with its own engine client and sockets, all accepting on the one
listening socket, and supervises them. SIGINT/SIGTERM stop everything; so does any of them exiting.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import uuid
from typing import Optional

from .api_server import AsyncEngineClient, _install_timed_protocol, build_app
from .config import add_engine_args, engine_config_from_args
from .launcher import Engines
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


def _http_socket(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


async def _serve_api(args: argparse.Namespace, cfg, ipc_dir: str, names: tuple[str, str], client_index: int,
                     sock: socket.socket, truth: TruthWriter, engines: Optional[Engines] = None,
                     on_serving=None, parent_pid: Optional[int] = None) -> None:
    """One API server: an engine client and uvicorn on the shared listening socket, until a signal
    (or, in a spawned API server, the death of the process that started it)."""
    import uvicorn

    _Server = _server_class()
    client = AsyncEngineClient(cfg, ipc_dir, names, client_index, engines)
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

        async def watch() -> None:
            while not server.started:
                await asyncio.sleep(0.02)
            if on_serving is not None:
                on_serving()
            while parent_pid is not None and os.getppid() == parent_pid:
                await asyncio.sleep(0.5)
            if parent_pid is not None:  # orphaned: vLLM's API servers die with the main process
                server.request_exit()

        watcher = asyncio.create_task(watch())
        await server.serve(sockets=[sock])
        watcher.cancel()
    finally:
        await client.shutdown()


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None and hasattr(uvloop, "run"):
        uvloop.run(coro)  # as vLLM's API server
    else:
        asyncio.run(coro)


def run_api_server(args: argparse.Namespace, client_index: int, sock: socket.socket, ipc_dir: str,
                   names: tuple[str, str], serving, parent_pid: int) -> None:
    """Entry point of API server process ``client_index`` (``--api-server-count`` > 1)."""
    from .engine_core import _set_comm

    _set_comm(f"APIServer_{client_index}")
    cfg = engine_config_from_args(args)
    truth = TruthWriter(cfg.ground_truth)

    def on_serving() -> None:
        serving.send(os.getpid())
        serving.close()

    try:
        _run(_serve_api(args, cfg, ipc_dir, names, client_index, sock, truth, on_serving=on_serving,
                        parent_pid=parent_pid))
    finally:
        truth.close()


def _announce(args: argparse.Namespace, cfg, port: int, api_pids: list[int], engines: Engines) -> None:
    print(f"testbed: serving {cfg.model_name} on http://{args.host}:{port} "
          f"(api pid {', '.join(map(str, api_pids))}, engine pid {', '.join(str(p.pid) for p in engines.procs)}, "
          f"device {cfg.device})", file=sys.stderr, flush=True)
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(f"{port}\n")
        os.replace(tmp, args.port_file)


def _serve_many(args: argparse.Namespace, cfg, sock: socket.socket, port: int, ipc_dir: str,
                names: tuple[str, str], engines: Engines) -> int:
    """vLLM's ``run_multi_api_server``: this process serves no HTTP; it starts the API server
    processes (each accepting on the one listening socket), waits for all of them to serve, then
    supervises: a signal, or any API server or engine exiting, stops everything."""
    stopping = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stopping.set())
    mp = multiprocessing.get_context("spawn")
    servers, pending = [], []
    for i in range(cfg.api_server_count):
        r, w = mp.Pipe(duplex=False)
        p = mp.Process(target=run_api_server, name=f"ApiServer_{i}",
                       args=(args, i, sock, ipc_dir, names, w, os.getpid()), daemon=True)
        p.start()
        w.close()
        servers.append(p)
        pending.append(r)
    rc, pids = 0, []

    def trouble() -> list[str]:
        return engines.dead() + [f"{p.name} exited ({p.exitcode})" for p in servers if not p.is_alive()]

    try:
        deadline = time.monotonic() + 180
        while pending and not stopping.is_set():
            for r in multiprocessing.connection.wait(pending, timeout=0.2):
                try:
                    pids.append(r.recv())
                except EOFError:
                    pass  # it exited before serving: trouble() says how
                pending.remove(r)
            if gone := trouble():
                print(f"testbed: {', '.join(gone)} during startup", file=sys.stderr, flush=True)
                return 1
            if time.monotonic() > deadline:
                print(f"testbed: {len(pending)} API server(s) not serving after 180 s", file=sys.stderr, flush=True)
                return 1
        if not stopping.is_set():
            _announce(args, cfg, port, pids, engines)
        while not stopping.wait(0.2):
            if gone := trouble():
                print(f"testbed: {', '.join(gone)}; stopping", file=sys.stderr, flush=True)
                rc = 1
                break
        return rc
    finally:
        for p in servers:
            if p.is_alive():
                p.terminate()  # SIGTERM: uvicorn finishes its responses
        for p in servers:
            p.join(timeout=15)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def serve(args: argparse.Namespace) -> int:
    cfg = engine_config_from_args(args)
    own_ipc = args.ipc_dir is None
    ipc_dir = args.ipc_dir or tempfile.mkdtemp(prefix="testbed-ipc-")
    os.makedirs(ipc_dir, exist_ok=True)
    truth = TruthWriter(cfg.ground_truth)
    truth.write({"type": "frontend_start", "pid": os.getpid(), "ns": time.monotonic_ns()})
    # Bind the HTTP socket first (as vLLM does) so the port is ours before the engine starts.
    sock = _http_socket(args.host, args.port)
    port = sock.getsockname()[1]
    # socket file names as vLLM's (uuid4s), unless given
    names = tuple(args.ipc_names.split(",", 1)) if args.ipc_names else (str(uuid.uuid4()), str(uuid.uuid4()))
    engines = Engines(cfg, ipc_dir, names, args.engine_ipc_dir)  # type: ignore[arg-type]
    rc = 0
    try:
        engines.start()
        if cfg.api_server_count > 1:
            rc = _serve_many(args, cfg, sock, port, ipc_dir, names, engines)  # type: ignore[arg-type]
        else:
            _run(_serve_api(args, cfg, ipc_dir, names, 0, sock, truth, engines,  # type: ignore[arg-type]
                            on_serving=lambda: _announce(args, cfg, port, [os.getpid()], engines)))
    finally:
        engines.stop()
        truth.write({"type": "frontend_stop", "pid": os.getpid(), "ns": time.monotonic_ns()})
        truth.close()
        if own_ipc:
            shutil.rmtree(ipc_dir, ignore_errors=True)
        else:
            for path in engines.paths():
                with contextlib.suppress(OSError):
                    os.unlink(path)
    return rc


def main(argv=None) -> None:
    sys.exit(serve(make_parser().parse_args(argv)))


if __name__ == "__main__":
    main()
