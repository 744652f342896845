"""The deployment examples' static check (examples/deploy/check.py: there is no cluster here),
run with the tests so the pod spec and the units cannot drift from docs/deploy.md unnoticed."""

import importlib.util
import pathlib
import shutil

import pytest

CHECK = pathlib.Path(__file__).resolve().parents[1] / "deploy" / "check.py"


def load_check():
    spec = importlib.util.spec_from_file_location("deploy_check", CHECK)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_kubernetes_pod_spec_has_the_documented_shape_and_privileges():
    assert load_check().main() == 0


def test_the_systemd_units_pass_systemd_analyze_verify():
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the systemd units' syntax is not verified")
    assert load_check().systemd_verify(analyze) == ""


def test_a_misspelt_key_in_a_unit_is_a_fault(tmp_path, monkeypatch):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze not installed: the systemd units' syntax is not verified")
    check = load_check()
    units = tmp_path / "systemd"
    shutil.copytree(check.HERE / "systemd", units)
    conf = units / "vllm-under-hopscope.conf"
    conf.write_text(conf.read_text().replace("LimitMEMLOCK=", "LimitMEMLOK="))
    monkeypatch.setattr(check, "HERE", tmp_path)
    assert "Unknown key 'LimitMEMLOK'" in check.systemd_verify(analyze)
