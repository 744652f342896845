"""The DP coordinator process (``--data-parallel-size`` > 1), shaped like vLLM's
``v1/engine/coordinator.py`` so that hopscope sees the same extra IPC a data-parallel vLLM makes.

Three sockets, all bound here on ``ipc://`` paths:
* front publish (XPUB): the API server subscribes (a lone ``01`` byte) and gets
  ``[[[waiting, running], …per engine], wave, running]`` every 100 ms while the load changes,
  else every 4 s; it sends back ``[engine_index, wave]`` when a request finds the engines paused;
* back output (PULL): each engine PUSHes stats-only ``EngineCoreOutputs`` (its request counts,
  after every step that changed them; no KV usage) and, from engine 0, ``wave_complete``;
* back publish (XPUB): each engine subscribes and gets ``START_DP_WAVE`` ``[02, [wave, exclude]]``
  when the API server woke the engines.

The emulation keeps vLLM's wire and timing shapes, not its lockstep: engines do not run dummy
batches, and a wave ends when engine 0 runs out of work.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

import msgspec
import zmq

from .protocol import EngineCoreOutputs, EngineCoreRequestType, make_outputs_decoder


class CoordinatorAddrs:
    """ipc:// addresses of the coordinator's three sockets in ``ipc_dir``."""

    def __init__(self, ipc_dir: str, tag: str):
        self.front_publish = f"ipc://{ipc_dir}/dp-coord-front-{tag}"
        self.back_output = f"ipc://{ipc_dir}/dp-coord-out-{tag}"
        self.back_publish = f"ipc://{ipc_dir}/dp-coord-in-{tag}"

    def paths(self) -> list[str]:
        return [a[len("ipc://"):] for a in (self.front_publish, self.back_output, self.back_publish)]


def run_coordinator(engine_count: int, addrs: CoordinatorAddrs, parent_pid: Optional[int] = None,
                    min_stats_update_interval_ms: int = 100) -> None:
    """Process entry point (multiprocessing 'spawn' target)."""
    from .engine_core import _set_comm

    _set_comm("DPCoordinator")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the API server shuts us down
    ctx = zmq.Context()
    front = ctx.socket(zmq.XPUB)
    back_out = ctx.socket(zmq.PULL)
    back_pub = ctx.socket(zmq.XPUB)
    for s, a in ((front, addrs.front_publish), (back_out, addrs.back_output), (back_pub, addrs.back_publish)):
        s.setsockopt(zmq.LINGER, 0)
        s.bind(a)
    decoder = make_outputs_decoder()
    counts = [[0, 0] for _ in range(engine_count)]  # [waiting, running] per engine
    wave, running, changed = 0, False, False
    poller = zmq.Poller()
    poller.register(front, zmq.POLLIN)
    poller.register(back_out, zmq.POLLIN)
    last_publish_ms = 0
    try:
        while True:
            if parent_pid is not None and os.getppid() != parent_pid:
                return
            elapsed = int(time.time() * 1000) - last_publish_ms
            wait_for = min_stats_update_interval_ms if changed else 4000
            # Bounded so that a vanished parent is noticed within a second.
            events = dict(poller.poll(timeout=min(1000, max(0, wait_for - elapsed))))
            if not events:
                if int(time.time() * 1000) - last_publish_ms >= wait_for:
                    front.send(msgspec.msgpack.encode((counts, wave, running)))
                    last_publish_ms = int(time.time() * 1000)
                    changed = False
                continue
            if front in events:
                buf = front.recv()
                if buf not in (b"\x01", b"\x00"):  # (un)subscriptions
                    exclude, req_wave = msgspec.msgpack.decode(buf)
                    if not running:
                        if req_wave < wave:
                            exclude = None  # a stale wave: every engine must hear it
                        running, changed = True, True
                        _start_wave(back_pub, wave, exclude)
            if back_out in events:
                out: EngineCoreOutputs = decoder.decode(back_out.recv())
                assert not out.outputs and out.utility_output is None
                st = out.scheduler_stats
                if st is not None:
                    # SchedulerStats is a map on the wire (decoded as a dict here).
                    counts[out.engine_index] = [st["num_waiting_reqs"], st["num_running_reqs"]]
                    changed = True
                if out.wave_complete is not None:
                    if wave <= out.wave_complete:
                        wave, running, changed = out.wave_complete + 1, False, True
                elif out.start_wave is not None and (out.start_wave > wave or (out.start_wave == wave and not running)):
                    wave, running, changed = out.start_wave, True, True
                    _start_wave(back_pub, wave, out.engine_index)
    except KeyboardInterrupt:
        pass
    finally:
        for s in (front, back_out, back_pub):
            s.close(linger=0)
        ctx.term()


def _start_wave(sock: zmq.Socket, wave: int, exclude: Optional[int]) -> None:
    sock.send_multipart((EngineCoreRequestType.START_DP_WAVE.value, msgspec.msgpack.encode((wave, exclude))))
