"""examples/kubernetes/: every manifest parses and validates against Kubernetes' schemas (kubectl client-side
where a cluster answers it, else the kubernetes-validate schemas offline), and every container runs a documented
pdcheck command whose flags the real CLI accepts (parsed by the command's own click parser, as `pdcheck <cmd>`
would)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
from typing import Any

import pytest
import typer
import yaml
from conftest import ROOT

from pdcheck import bounds
from pdcheck.cli import app
from pdcheck.doctor import addr

EXAMPLES = ROOT / "examples" / "kubernetes"
SAMPLE_IP = "10.244.0.9"  # what a fieldRef (status.podIP) or a shell's $(getent ...) stands for here
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _docs() -> list[Any]:
    return [d for f in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Job", "DaemonSet"):
        return doc["spec"]["template"]["spec"]
    if doc["kind"] == "Pod":
        return doc["spec"]
    return None


def _containers() -> list[tuple[str, dict, dict]]:
    out = []
    for d in _docs():
        spec = _pod_spec(d)
        for c in (spec or {}).get("containers", []):
            out.append((d["metadata"]["name"], c, d))
    return out


def _argv(c: dict) -> list[str]:
    """The pdcheck command line the container runs, with Kubernetes' $(VAR) expanded from its env and a
    `sh -c` script's substitutions replaced by a sample address."""
    env = {e["name"]: e.get("value", SAMPLE_IP) for e in c.get("env", [])}
    argv = [*c.get("command", []), *c.get("args", [])]
    argv = [re.sub(r"\$\((\w+)\)", lambda mt: env.get(mt[1], mt[0]), a) for a in argv]
    if argv[:2] in (["sh", "-c"], ["bash", "-c"]):
        script = re.sub(r"\$\([^)]*\)", SAMPLE_IP, argv[2])
        toks = shlex.split(script)
        start = toks.index("pdcheck")
        end = next((i for i in range(start, len(toks)) if toks[i] in ("&&", "||", ";", "|")), len(toks))
        argv = toks[start:end]
    assert argv and argv[0] == "pdcheck", argv
    return argv[1:]


def test_manifests_parse_and_cover_the_three_examples() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in _docs())
    assert ("Service", "pdcheck-doctor-listener") in kinds
    names = {n for k, n in kinds if k == "Job"}
    assert {"pdcheck-doctor-node", "pdcheck-probe-prefill", "pdcheck-doctor-listener", "pdcheck-doctor-peer",
            "pdcheck-doctor-matrix"} <= names
    assert ("DaemonSet", "pdcheck-doctor-listeners") in kinds
    for d in _docs():
        assert d["apiVersion"] in ("v1", "batch/v1", "apps/v1") and d["metadata"]["name"].startswith("pdcheck-")


@pytest.mark.parametrize("name", ["pdcheck-doctor-node", "pdcheck-probe-prefill", "pdcheck-doctor-listener",
                                  "pdcheck-doctor-peer", "pdcheck-doctor-listeners", "pdcheck-doctor-matrix"])
def test_container_runs_a_documented_command_with_real_flags(name: str) -> None:
    root = typer.main.get_command(app)
    (c,) = [c for n, c, _ in _containers() if n == name]
    args = _argv(c)
    cmd_name, rest = args[0], args[1:]
    cmd = root.get_command(None, cmd_name)  # type: ignore[attr-defined]
    assert cmd is not None, f"{name}: pdcheck has no command {cmd_name!r}"
    assert f"pdcheck {cmd_name}" in DOCS, f"{name}: `pdcheck {cmd_name}` is not documented"
    # The command's own parser: an unknown flag, a missing value or a value of the wrong type raises here.
    ctx = cmd.make_context(f"pdcheck {cmd_name}", list(rest))
    params = ctx.params
    assert params.get("json_out") is True, f"{name}: the Job's log should be the --json document"
    # The values pdcheck itself checks before anything starts (what would be exit 2 in the pod).
    # Names (a Service's) resolve only in the cluster: here their form is checked, as pdcheck checks it first.
    if cmd_name == "doctor":
        if params["listen"] is not None:
            addr.parse_listen(params["listen"])
            assert params["advertise"] is not None, "a bind-all listener in a pod must advertise its pod IP"
            assert addr.parse_advertise(params["advertise"]) == f"{SAMPLE_IP}:7777"
        if params["peer"] is not None:
            addr.parse_hostport("--peer", params["peer"])
        for item in (params["matrix"] or "").split(","):
            if item:
                addr.parse_hostport("--matrix", item)
    if cmd_name == "probe":
        host = rest[0].rpartition(":")[0]
        bounds.check_host(name, "HOST", host)


def test_the_pair_meets_through_its_service() -> None:
    svc = next(d for d in _docs() if d["kind"] == "Service" and d["metadata"]["name"] == "pdcheck-doctor-listener")
    lis = next(d for d in _docs() if d["metadata"]["name"] == "pdcheck-doctor-listener" and d["kind"] == "Job")
    labels = lis["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    port = svc["spec"]["ports"][0]["targetPort"]
    (lc,) = lis["spec"]["template"]["spec"]["containers"]
    assert _argv(lc)[_argv(lc).index("--listen") + 1].endswith(f":{port}")
    (pc,) = [c for n, c, _ in _containers() if n == "pdcheck-doctor-peer"]
    # the peer dials the Service by its name: doctor resolves it (no getent in a shell first)
    assert pc["command"][0] == "pdcheck"
    assert _argv(pc)[_argv(pc).index("--peer") + 1] == f"{svc['metadata']['name']}:{port}"


def test_the_matrix_asks_every_listener_of_the_daemonset() -> None:
    """The matrix Job names the headless Service over the DaemonSet's pods, at the port they listen on, and each
    listener keeps listening and advertises its own pod IP."""
    svc = next(d for d in _docs() if d["kind"] == "Service" and d["metadata"]["name"] == "pdcheck-doctor")
    ds = next(d for d in _docs() if d["kind"] == "DaemonSet")
    assert svc["spec"]["clusterIP"] == "None"  # headless: its name gives every pod's address
    labels = ds["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    port = svc["spec"]["ports"][0]["targetPort"]
    (lc,) = ds["spec"]["template"]["spec"]["containers"]
    args = _argv(lc)
    assert "--keep-listening" in args and args[args.index("--listen") + 1] == f"0.0.0.0:{port}"
    assert lc["readinessProbe"]["tcpSocket"]["port"] == port
    (mc,) = [c for n, c, _ in _containers() if n == "pdcheck-doctor-matrix"]
    margs = _argv(mc)
    assert margs[margs.index("--matrix") + 1] == f"{svc['metadata']['name']}:{port}"


def _kubectl_answers() -> bool:
    if shutil.which("kubectl") is None:
        return False
    r = subprocess.run(["kubectl", "version", "--request-timeout=5s"], capture_output=True, text=True, timeout=30)
    return r.returncode == 0


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_manifest_validates_against_the_kubernetes_schemas(path) -> None:
    """kubectl's client-side dry run where a cluster answers it (kubectl needs its API discovery even then);
    otherwise the same schemas offline (kubernetes-validate, strict: an unknown field fails)."""
    if _kubectl_answers():
        r = subprocess.run(["kubectl", "apply", "--dry-run=client", "-f", str(path)], capture_output=True, text=True,
                           timeout=60)
    elif shutil.which("kubernetes-validate") is not None:
        r = subprocess.run(["kubernetes-validate", "--strict", str(path)], capture_output=True, text=True, timeout=120)
    else:
        pytest.skip("neither a cluster for kubectl nor kubernetes-validate (pip install 'pdcheck[test]')")
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.parametrize("argv", [["doctor", "--listen", "0.0.0.0:7777", "--no-such-flag"], ["doctor", "--pairs", "x"],
                                  ["probe", "10.0.0.1:5600", "--vllm"]])
def test_the_check_refuses_flags_the_cli_refuses(argv: list[str]) -> None:
    from pdcheck.errors import usage_error_types

    cmd = typer.main.get_command(app).get_command(None, argv[0])  # type: ignore[attr-defined]
    with pytest.raises(usage_error_types()):
        cmd.make_context(f"pdcheck {argv[0]}", argv[1:])
