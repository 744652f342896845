"""The engine side of ``testbed.serve``: the EngineCore processes and, when data-parallel, the DP
coordinator — started by the process that runs ``serve`` (as vLLM's ``launch_core_engines``),
whether it also serves HTTP (one API server) or spawns the API server processes
(``--api-server-count`` > 1).

Addresses, as vLLM's: every API server (engine client) ``i`` binds its own input ROUTER and output
PULL; client 0 uses the two socket names as given (tests relay them), client ``i`` appends ``.i``.
Every engine connects a DEALER and a PUSH to each client's pair.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import Optional

from .config import EngineConfig
from .coordinator import CoordinatorAddrs, run_coordinator
from .engine_core import run_engine_core


def client_ipc_names(names: tuple[str, str], client_index: int) -> tuple[str, str]:
    """The (input, output) socket file names of engine client ``client_index``."""
    if client_index == 0:
        return names
    return f"{names[0]}.{client_index}", f"{names[1]}.{client_index}"


def coordinator_addrs(ipc_dir: str, names: tuple[str, str]) -> CoordinatorAddrs:
    return CoordinatorAddrs(ipc_dir, names[0][:8])


class Engines:
    """The engine processes (and the DP coordinator) of one testbed, owned by the process that
    started them: it alone can see them die and stops them."""

    def __init__(self, cfg: EngineConfig, ipc_dir: str, names: tuple[str, str], engine_ipc_dir: Optional[str] = None):
        self.cfg = cfg
        self.ipc_dir = ipc_dir
        self.names = names
        self.engine_ipc_dir = engine_ipc_dir or ipc_dir
        self.count = max(1, cfg.data_parallel_size)
        self.clients = max(1, cfg.api_server_count)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.coord_proc: Optional[multiprocessing.process.BaseProcess] = None
        self.coord: Optional[CoordinatorAddrs] = coordinator_addrs(ipc_dir, names) if self.count > 1 else None

    def start(self) -> None:
        mp = multiprocessing.get_context("spawn")
        pairs = [client_ipc_names(self.names, i) for i in range(self.clients)]
        engine_in = [f"ipc://{self.engine_ipc_dir}/{a}" for a, _ in pairs]
        engine_out = [f"ipc://{self.engine_ipc_dir}/{b}" for _, b in pairs]
        coord_addrs = None
        if self.coord is not None:
            self.coord_proc = mp.Process(target=run_coordinator, name="VLLM_DP_Coordinator",
                                         args=(self.count, self.coord, os.getpid()), daemon=True)
            self.coord_proc.start()
            coord_addrs = (self.coord.back_publish, self.coord.back_output)
        for i in range(self.count):
            cfg = dataclasses.replace(self.cfg, engine_index=i) if self.count > 1 else self.cfg
            p = mp.Process(target=run_engine_core, name=f"EngineCore_DP{cfg.engine_index}",
                           args=(cfg, engine_in, engine_out, os.getpid(), coord_addrs), daemon=True)
            p.start()
            self.procs.append(p)

    def dead(self) -> list[str]:
        """What has exited, in words; empty while every process runs."""
        procs = self.procs + ([self.coord_proc] if self.coord_proc is not None else [])
        return [f"{p.name} exited ({p.exitcode})" for p in procs if not p.is_alive()]

    def stop(self) -> None:
        if self.coord_proc is not None and self.coord_proc.is_alive():
            self.coord_proc.terminate()
            self.coord_proc.join(timeout=5)
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)

    def paths(self) -> list[str]:
        """Every ipc socket file of this testbed (the clients' and the coordinator's)."""
        out = []
        for i in range(self.clients):
            out += [os.path.join(self.ipc_dir, n) for n in client_ipc_names(self.names, i)]
        return out + (self.coord.paths() if self.coord is not None else [])
