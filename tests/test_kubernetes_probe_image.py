"""The Kubernetes probe example runs pdcheck inside the serving image the prefill already runs: the wheel from a
ConfigMap, installed with --no-deps (tests/test_wheel_in_serving_image.py shows that image has what pdcheck
needs), or baked in by examples/kubernetes/Dockerfile `FROM` that image. kubectl validates the manifest where it
reaches an API server (it needs one for the schema)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from conftest import ROOT

EXAMPLES = ROOT / "examples" / "kubernetes"
PROBE = EXAMPLES / "probe-prefill.yaml"


def _job() -> dict:
    (doc,) = [d for d in yaml.safe_load_all(PROBE.read_text()) if d]
    return doc


def test_the_probe_job_installs_the_wheel_no_deps_into_the_serving_image() -> None:
    spec = _job()["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert re.fullmatch(r"(vllm/vllm-openai|lmsysorg/sglang):v?[\w.]+", c["image"]), c["image"]  # a serving image
    assert c["command"][:2] == ["sh", "-c"]
    script = shlex.split(c["command"][2])
    pip = script[:script.index("&&")]
    assert pip[:2] == ["pip", "install"] and "--no-deps" in pip and "--no-index" in pip
    wheel = pip[-1]
    (mount,) = c["volumeMounts"]
    assert wheel.startswith(mount["mountPath"] + "/") and re.fullmatch(r".*/pdcheck-[\d.]+-py3-none-any\.whl", wheel)
    (vol,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    assert vol["configMap"]["name"] == "pdcheck-wheel"
    assert f"configmap {vol['configMap']['name']} --from-file=dist/{wheel.rsplit('/', 1)[1]}" in PROBE.read_text()
    assert script[script.index("&&") + 1] == "pdcheck"


def test_the_dockerfile_bakes_the_wheel_into_a_serving_image() -> None:
    lines = [ln.strip() for ln in (EXAMPLES / "Dockerfile").read_text().splitlines() if ln.strip()
             and not ln.startswith("#")]
    arg = next(ln for ln in lines if ln.startswith("ARG SERVING_IMAGE="))
    assert re.fullmatch(r"ARG SERVING_IMAGE=(vllm/vllm-openai|lmsysorg/sglang):v?[\w.]+", arg)
    assert "FROM ${SERVING_IMAGE}" in lines
    run = next(ln for ln in lines if ln.startswith("RUN "))
    assert "pip install" in run and "--no-deps" in run and "pdcheck --version" in run


def test_kubectl_validates_the_manifest_where_it_reaches_a_cluster() -> None:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed here")
    r = subprocess.run(["kubectl", "create", "--dry-run=client", "-o", "name", "-f", str(PROBE)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and re.search(r"connection refused|failed to download openapi|unable to recognize", r.stderr):
        pytest.skip(f"kubectl reaches no API server here (it needs one for the schema): {r.stderr.splitlines()[0]}")
    assert r.returncode == 0 and r.stdout.strip() == "job.batch/pdcheck-probe-prefill", r.stderr
