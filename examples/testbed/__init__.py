"""hopscope testbed: a small server shaped like vLLM V1 (API server process + EngineCore
process talking ZeroMQ/msgpack in vLLM 0.33.0's layouts) with a random-weight model.

See examples/README.md. Modules:
  protocol      msgspec structs mirroring vLLM 0.33.0 EngineCoreRequest / EngineCoreOutputs
  tokenizer     deterministic byte-level tokenizer + chat template
  kv_cache      paged KV block pool, block-hash prefix cache, host offload bookkeeping
  scheduler     continuous batching, chunked prefill, preemption (recompute)
  model_numpy   CPU model (numpy), model_torch: GPU model (torch, optional)
  engine_core   the EngineCore process (input thread, step loop, output thread)
  api_server    FastAPI frontend + the ZeroMQ client (AsyncLLM-like)
  serve         command line: python -m testbed.serve
  truth         --ground-truth JSONL writer
"""

__version__ = "0.1.0"
EMULATED_VLLM_VERSION = "0.33.0"
