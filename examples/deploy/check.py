"""Static checks of the deployment examples (there is no cluster in CI): the pod spec parses,
is a valid Pod for every Kubernetes release from 1.28 on (the API's own schemas, strict: an
unknown or misspelt field fails), has the shape docs/deploy.md describes, and asks for no more
privilege than documented."""

import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

import kubernetes_validate
import yaml

HERE = pathlib.Path(__file__).parent
# The oldest release checked: the examples need nothing newer (shareProcessNamespace is GA since
# 1.17, CAP_BPF/CAP_PERFMON are plain capability names); older ones are out of support.
OLDEST = (1, 28)


def kubernetes_releases() -> list[str]:
    """The releases kubernetes-validate bundles schemas for, from OLDEST to its latest."""
    latest = tuple(int(x) for x in kubernetes_validate.latest_version().split("."))
    return [f"1.{minor}" for minor in range(OLDEST[1], latest[1] + 1)]


def main() -> int:
    pod = yaml.safe_load((HERE / "kubernetes/vllm-with-hopscope.yaml").read_text())
    releases = kubernetes_releases()
    assert len(releases) >= 10, releases
    for v in releases:
        # Raises a ValidationError naming the field and the schema rule it broke.
        kubernetes_validate.validate(pod, v, strict=True)
    # The pod's own pid namespace, shared by its containers: not the host's (docs/deploy.md).
    assert pod["kind"] == "Pod" and pod["spec"]["shareProcessNamespace"] is True and not pod["spec"].get("hostPID"), pod["spec"]
    containers = {c["name"]: c for c in pod["spec"]["containers"]}
    agent = containers["hopscope"]
    sc = agent["securityContext"]
    assert sc["privileged"] is False and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"], "add": ["BPF", "PERFMON"]}, sc["capabilities"]
    mounts = {m["mountPath"]: m for m in agent["volumeMounts"]}
    assert mounts["/sys/kernel/tracing"]["readOnly"] is True
    assert "/hopscope" in {m["mountPath"] for m in containers["vllm"]["volumeMounts"]}
    assert "securityContext" not in containers["vllm"] or not containers["vllm"]["securityContext"].get("privileged")
    args = agent["args"][0]
    # --pid-file: a restarted vLLM container writes its new pid there, and the agent follows it.
    assert "--cupti-lib /hopscope/libhopscope_cupti.so" in args and "hopscope record --pid-file /hopscope/vllm.pid" in args
    assert "echo $$ > /hopscope/vllm.pid" in containers["vllm"]["args"][0]
    # Left running: a bounded disk (segments, the newest kept), and nothing
    # written only at stop (--perfetto is one file of one run).
    assert "--rotate-every" in args and "--keep" in args and "--perfetto" not in args, args
    env = {e["name"]: e.get("value") for e in agent["env"]}
    assert "OTLP_ENDPOINT" in env and '${OTLP_ENDPOINT:+--otlp "$OTLP_ENDPOINT"}' in args, args
    # The spans' resource names the pod (downward API, referenced before use).
    names = [e["name"] for e in agent["env"]]
    assert env["OTEL_RESOURCE_ATTRIBUTES"] == "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE)", env
    assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES") and names.index("POD_NAMESPACE") < names.index("OTEL_RESOURCE_ATTRIBUTES")
    # Prometheus finds the metrics where the agent serves them.
    ann = pod["metadata"]["annotations"]
    port = next(p["containerPort"] for p in agent["ports"] if p["name"] == "metrics")
    assert f"--metrics 0.0.0.0:{port}" in args and ann["prometheus.io/port"] == str(port) and ann["prometheus.io/scrape"] == "true", (ann, port)
    # The Grafana dashboard is JSON with panels querying hopscope's series
    # (which series exist: sink::metrics the_grafana_dashboard_queries_only_series_that_exist).
    import json
    dash = json.loads((HERE / "grafana/hopscope.json").read_text())
    assert any("hopscope_time_to_first_token_seconds_bucket" in t["expr"] for p in dash["panels"] for t in p.get("targets", []))
    print(f"kubernetes/vllm-with-hopscope.yaml (a valid Pod for Kubernetes {releases[0]}-{releases[-1]}), grafana/hopscope.json: ok")
    # The systemd units record for as long as vLLM runs: rotated, bounded, and
    # named per start so that a restart never overwrites the last run's files.
    for unit in ["systemd/hopscope.service", "systemd/vllm-under-hopscope.conf"]:
        text = (HERE / unit).read_text()
        start = [l for l in text.splitlines() if l.startswith("ExecStart=") and len(l) > len("ExecStart=")]
        assert len(start) == 1, (unit, start)
        line = start[0]
        assert "--rotate-every 1h" in line and "--keep 48" in line and "$(date +%%Y%%m%%d-%%H%%M%%S)" in line, (unit, line)
        print(f"{unit}: ok")
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        print("systemd-analyze not found: the units' syntax NOT verified (tests/test_deploy.py skips it)")
    else:
        complaints = systemd_verify(analyze)
        assert not complaints, complaints
        print("systemd units: systemd-analyze verify found nothing")
    return 0


def systemd_verify(analyze: str) -> str:
    """systemd's own reading of the units: `systemd-analyze verify` of hopscope.service and of a
    stand-in vllm.service carrying the drop-in, from a scratch unit path. Returns what it said,
    '' when nothing: to systemd an unknown key is a warning that ignores the line, here a fault."""
    with tempfile.TemporaryDirectory() as tmp:
        d = pathlib.Path(tmp)
        shutil.copy(HERE / "systemd/hopscope.service", d)
        (d / "vllm.service").write_text("[Unit]\nDescription=stand-in for vLLM's own unit\n[Service]\nExecStart=/bin/sleep infinity\n")
        (d / "vllm.service.d").mkdir()
        shutil.copy(HERE / "systemd/vllm-under-hopscope.conf", d / "vllm.service.d")
        # The trailing ':' appends systemd's own search path (for the targets units name).
        env = dict(os.environ, SYSTEMD_UNIT_PATH=f"{d}:")
        p = subprocess.run([analyze, "verify", "hopscope.service", "vllm.service"], cwd=d, env=env,
                           capture_output=True, text=True, timeout=120)
        said = (p.stdout + p.stderr).strip()
        return said if p.returncode == 0 else f"{said}\n(systemd-analyze exited {p.returncode})"


if __name__ == "__main__":
    sys.exit(main())
