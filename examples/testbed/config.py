"""Command-line knobs shared by the API server and the engine process."""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Optional

from .model_numpy import ModelConfig
from .protocol import WIRE_VERSIONS


@dataclass
class EngineConfig:
    model_name: str = "hopscope-testbed"
    device: str = "cpu"  # "cpu" (numpy) | "cuda" (torch) | "torch-cpu" (torch code path on CPU)
    dtype: str = "auto"  # torch only: auto (bf16 on cuda, fp32 on cpu) | float32 | bfloat16 | float16
    block_size: int = 16
    num_kv_blocks: int = 2048
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 32
    enable_prefix_caching: bool = True
    kv_offload: bool = False
    kv_offload_blocks: int = 8192
    cuda_graphs: bool = False
    # each step's GPU records played through the CUPTI ABI test double (cupti_double.py): CI only
    cupti_test_double: bool = False
    log_stats: bool = True
    allow_eos: bool = False
    engine_index: int = 0
    # engines behind the one API server (vLLM --data-parallel-size): engine i is EngineCore_DP<i>
    data_parallel_size: int = 1
    # engine clients (vLLM --api-server-count: N API server processes, each its own client_index;
    # emulated by N clients in the one API server process)
    api_server_count: int = 1
    ground_truth: Optional[str] = None
    step_sleep_ms: float = 0.0  # artificial extra time per step (slows the engine down for demos)
    grammar_compile_ms: float = 40.0  # a structured-output request's grammar compile (once per constraint)
    scheduling_policy: str = "fcfs"  # vLLM --scheduling-policy: fcfs or priority
    vllm_wire: str = "0.33.0"  # the vLLM release whose engine IPC layout the testbed speaks
    model: ModelConfig = field(default_factory=ModelConfig)

    @property
    def max_model_len(self) -> int:
        return self.model.max_model_len

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("engine")
    g.add_argument("--model", dest="model_name", default="hopscope-testbed", help="served model name")
    g.add_argument("--device", default="cpu", choices=["cpu", "cuda", "torch-cpu"],
                   help="cpu = numpy model; cuda = torch on the GPU; torch-cpu = torch code path on CPU")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    g.add_argument("--block-size", type=int, default=16)
    g.add_argument("--num-kv-blocks", type=int, default=2048, help="device KV pool size in blocks")
    g.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget per step")
    g.add_argument("--max-num-seqs", type=int, default=32, help="max running requests")
    g.add_argument("--max-model-len", type=int, default=16384)
    g.add_argument("--no-prefix-cache", dest="enable_prefix_caching", action="store_false",
                   help="disable the block-hash prefix cache")
    g.add_argument("--kv-offload", action="store_true",
                   help="copy evicted KV blocks to host memory and back on a prefix hit")
    g.add_argument("--kv-offload-blocks", type=int, default=8192, help="host KV pool size in blocks")
    g.add_argument("--cuda-graphs", action="store_true", help="capture decode steps in CUDA graphs")
    g.add_argument("--cupti-test-double", action="store_true",
                   help="TEST DOUBLE, for CI without a GPU: each engine step's records as a GPU model "
                        "runner's, through the CUPTI ABI test double (testbed/cupti_double.py; needs "
                        "hopscope run and CUPTI_ABI_TEST_DOUBLE); never GPU evidence")
    g.add_argument("--disable-log-stats", dest="log_stats", action="store_false",
                   help="no QUEUED/SCHEDULED/PREEMPTED events on the output IPC (as vLLM)")
    g.add_argument("--allow-eos", action="store_true",
                   help="let the random model sample EOS (finish_reason stop at random)")
    g.add_argument("--d-model", type=int, default=256)
    g.add_argument("--n-layers", type=int, default=4)
    g.add_argument("--n-heads", type=int, default=4)
    g.add_argument("--d-ff", type=int, default=512)
    g.add_argument("--seed", type=int, default=0, help="model weight seed")
    g.add_argument("--step-sleep-ms", type=float, default=0.0,
                   help="extra sleep inside every engine step (inside the step's span)")
    g.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                   help="as vLLM's: fcfs, or priority (the waiting queue by the request's priority, "
                        "lower first, then arrival; the highest preempted first)")
    g.add_argument("--grammar-compile-ms", type=float, default=40.0,
                   help="how long a structured-output request's grammar takes to compile; it waits in "
                        "the queue meanwhile, later requests scheduled past it, as vLLM's (a constraint "
                        "seen before is ready at once, as xgrammar's cache)")
    g.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="engine processes behind the API server, each with its own model and KV cache "
                        "(vLLM's data parallelism; requests go to the engine with the fewest in flight)")
    g.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="engine clients, requests spread over them in turn (vLLM runs N API server "
                        "processes, each with its own sockets to every engine; here N clients in one "
                        "process: the engines send each step as one message per client, as vLLM)")
    g.add_argument("--vllm-wire", default="0.33.0", choices=WIRE_VERSIONS,
                   help="the vLLM release whose engine IPC the API server and engine speak: 0.34.0 adds "
                        "a trailing field to requests and outputs and packs an ADD's prompt ids into an "
                        "int32 array, in a ZeroMQ frame of its own from 64 ids")
    g.add_argument("--ground-truth", default=None, metavar="FILE",
                   help="append CLOCK_MONOTONIC ground truth (JSONL) from both processes")


def engine_config_from_args(a: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model_name=a.model_name,
        device=a.device,
        dtype=a.dtype,
        block_size=a.block_size,
        num_kv_blocks=a.num_kv_blocks,
        max_num_batched_tokens=a.max_num_batched_tokens,
        max_num_seqs=a.max_num_seqs,
        enable_prefix_caching=a.enable_prefix_caching,
        kv_offload=a.kv_offload,
        kv_offload_blocks=a.kv_offload_blocks,
        cuda_graphs=a.cuda_graphs,
        cupti_test_double=a.cupti_test_double,
        log_stats=a.log_stats,
        allow_eos=a.allow_eos,
        data_parallel_size=a.data_parallel_size,
        api_server_count=a.api_server_count,
        ground_truth=a.ground_truth,
        step_sleep_ms=a.step_sleep_ms,
        grammar_compile_ms=a.grammar_compile_ms,
        scheduling_policy=a.scheduling_policy,
        vllm_wire=a.vllm_wire,
        model=ModelConfig(d_model=a.d_model, n_layers=a.n_layers, n_heads=a.n_heads, d_ff=a.d_ff,
                          max_model_len=a.max_model_len, seed=a.seed),
    )
