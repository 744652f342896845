"""The engine's steps shown to CUPTI as a GPU would show them, through the CUPTI ABI TEST DOUBLE.

``--cupti-test-double`` (CI without a GPU): the engine process plays the CUDA driver — it loads
the injection library ``hopscope run`` hands it (``CUDA_INJECTION64_PATH``) and calls
``InitializeInjection`` — and after every step it places, through the CUPTI ABI test double
(tests/cupti-double, ``CUPTI_ABI_TEST_DOUBLE``; the injection loads it as libcupti through
``HOPSCOPE_CUPTI_LIB``), the records a GPU model runner's step would leave, at the times the
step's CPU work took:

- each KV block copy to or from host memory (``--kv-offload``): a pinned copy of its bytes;
- per layer a GEMM, a ``reshape_and_cache_flash_kernel`` with one block per new token (vLLM's
  grid), and an attention kernel, spread over the forward pass; decode-only steps with
  ``--cuda-graphs`` run them as nodes of one graph per batch-size bucket (and, when the library
  asked for graphs per launch, CUPTI's one GRAPH_TRACE record instead);
- a step that sampled: the sampled ids copied into pinned host memory (8 bytes a request) and
  an event synchronize that waited for it, returning when the step's ``sample_end_ns`` truth
  mark was taken; a step without outputs: a stream synchronize and no copy (as model_torch.py).

So the injection library, its socket, the agent and the correlator run on the testbed's real
step pattern in real processes, and examples/gpu/check_gpu_steps.py can be run without a GPU.
It says nothing about a GPU's timing, CUPTI's behaviour or its cost: that is
scripts/gpu-check.sh's, on a GPU.
"""

from __future__ import annotations

import ctypes
import os

STREAM = 7
COPY_HTOD, COPY_DTOH = 1, 2
SYNC_EVENT, SYNC_STREAM = 1, 3
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class CuptiDoubleGpu:
    def __init__(self, n_layers: int, cuda_graphs: bool):
        inj = os.environ.get("CUDA_INJECTION64_PATH")
        dbl = os.environ.get("CUPTI_ABI_TEST_DOUBLE")
        if not inj or not dbl:
            raise RuntimeError("--cupti-test-double needs CUDA_INJECTION64_PATH (hopscope run sets it) and "
                               "CUPTI_ABI_TEST_DOUBLE (the test double's path, also given as HOPSCOPE_CUPTI_LIB)")
        # As the CUDA driver does at cuInit: 1 = the library is in, 0 = it declined (CUDA goes on).
        self.init_rc = ctypes.CDLL(inj).InitializeInjection()
        d = ctypes.CDLL(dbl)
        u64, u32, u8 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint8
        self._kernel = d.cupti_abi_test_double_kernel
        self._kernel.argtypes = [ctypes.c_char_p, u64, u64, u32, u32, u32, u64]
        self._memcpy = d.cupti_abi_test_double_memcpy
        self._memcpy.argtypes = [u8, u64, u64, u64, u32]
        self._sync = d.cupti_abi_test_double_sync
        self._sync.argtypes = [u32, u64, u64, u32]
        self._graph = d.cupti_abi_test_double_graph
        self._graph.argtypes = [u32, u64, u64, u32]
        self.n_layers = max(1, n_layers)
        self.cuda_graphs = cuda_graphs
        # records the double could not place (no buffer from the library): its own count goes to
        # the library as CUPTI's dropped records; this one is for the engine's truth line
        self.unplaced = 0

    def _put(self, rc: int) -> None:
        if rc < 0:
            self.unplaced += 1

    def step(self, num_tokens: int, decode_only: bool, copies, marks: dict, n_sampled: int) -> None:
        """One engine step: `copies` its KV copy records (dir d2h/h2d, start_ns/end_ns/bytes),
        `marks` the runner's copies_end_ns/forward_end_ns/sample_end_ns."""
        for c in copies:
            kind = COPY_DTOH if c.dir == "d2h" else COPY_HTOD
            self._put(self._memcpy(kind, c.bytes, c.start_ns, max(c.end_ns, c.start_ns + 1), STREAM))
        f0, f1, s = marks["copies_end_ns"], marks["forward_end_ns"], marks["sample_end_ns"]
        f1 = max(f1, f0 + 3 * self.n_layers * 3)
        graph = 0
        if self.cuda_graphs and decode_only:
            graph = next((i + 1 for i, b in enumerate(GRAPH_BUCKETS) if b >= num_tokens), 0)
        slot = (f1 - f0) // self.n_layers
        node = 0
        for layer in range(self.n_layers):
            a = f0 + layer * slot
            parts = ((b"hs_testbed_gemm_qkv", 0, 4), (b"reshape_and_cache_flash_kernel", 4, 5),
                     (b"hs_testbed_attention", 5, 9))
            for name, lo, hi in parts:
                node += 1
                grid = num_tokens if name.startswith(b"reshape") else 64
                self._put(self._kernel(name, a + slot * lo // 10, a + max(slot * hi // 10, slot * lo // 10 + 1),
                                       grid, STREAM, graph, graph * 1000 + node))
        if graph:
            self._put(self._graph(graph, f0, f1, STREAM))
        if n_sampled:
            # vLLM's step end: sampled ids -> pinned host buffer, then an event synchronize
            copy_end = max(s - 1_000, f1 + 2)
            self._put(self._memcpy(COPY_DTOH, 8 * n_sampled, max(f1 + 1, copy_end - 2_000), copy_end, STREAM))
            self._put(self._sync(SYNC_EVENT, f1, max(s, copy_end + 1), STREAM))
        else:
            self._put(self._sync(SYNC_STREAM, f1, max(s, f1 + 1), STREAM))
