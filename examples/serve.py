#!/usr/bin/env python3
"""Launcher: ``python examples/serve.py --port 8000 [...]`` == ``python -m testbed.serve`` with
examples/ on the path. See examples/README.md."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from testbed.serve import main  # noqa: E402

if __name__ == "__main__":
    main()
