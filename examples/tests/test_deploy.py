"""The deployment examples' static check (examples/deploy/check.py: there is no cluster here),
run with the tests so the pod spec cannot drift from docs/deploy.md unnoticed."""

import importlib.util
import pathlib

CHECK = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "check.py"


def test_the_kubernetes_pod_spec_has_the_documented_shape_and_privileges():
    spec = importlib.util.spec_from_file_location("deploy_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main() == 0
