"""examples/kubernetes/: every manifest parses, and every container runs a documented pdcheck command whose
flags the real CLI accepts (parsed by the command's own click parser, as `pdcheck <cmd>` would)."""

from __future__ import annotations

import re
import shlex
from typing import Any

import pytest
import typer
import yaml
from conftest import ROOT

from pdcheck import bounds
from pdcheck.cli import app
from pdcheck.doctor import pair

EXAMPLES = ROOT / "examples" / "kubernetes"
SAMPLE_IP = "10.244.0.9"  # what a fieldRef (status.podIP) or a shell's $(getent ...) stands for here
DOCS = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _docs() -> list[Any]:
    return [d for f in sorted(EXAMPLES.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]


def _pod_spec(doc: dict) -> dict | None:
    if doc["kind"] in ("Job",):
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
    assert {"pdcheck-doctor-node", "pdcheck-probe-prefill", "pdcheck-doctor-listener", "pdcheck-doctor-peer"} <= names
    for d in _docs():
        assert d["apiVersion"] in ("v1", "batch/v1") and d["metadata"]["name"].startswith("pdcheck-")


@pytest.mark.parametrize("name", ["pdcheck-doctor-node", "pdcheck-probe-prefill", "pdcheck-doctor-listener",
                                  "pdcheck-doctor-peer"])
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
    if cmd_name == "doctor":
        if params["listen"] is not None:
            pair.parse_listen(params["listen"])
            assert params["advertise"] is not None, "a bind-all listener in a pod must advertise its pod IP"
            pair.check_advertised(params["advertise"], name)
        if params["peer"] is not None:
            pair.parse_peer(params["peer"])
    if cmd_name == "probe":
        host = rest[0].rpartition(":")[0]
        bounds.check_host(name, "HOST", host)


def test_the_pair_meets_through_its_service() -> None:
    svc = next(d for d in _docs() if d["kind"] == "Service")
    lis = next(d for d in _docs() if d["metadata"]["name"] == "pdcheck-doctor-listener" and d["kind"] == "Job")
    labels = lis["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    port = svc["spec"]["ports"][0]["targetPort"]
    (lc,) = lis["spec"]["template"]["spec"]["containers"]
    assert _argv(lc)[_argv(lc).index("--listen") + 1].endswith(f":{port}")
    (pc,) = [c for n, c, _ in _containers() if n == "pdcheck-doctor-peer"]
    assert svc["metadata"]["name"] in pc["command"][-1]  # the peer resolves the Service's name
    assert _argv(pc)[_argv(pc).index("--peer") + 1] == f"{SAMPLE_IP}:{port}"


@pytest.mark.parametrize("argv", [["doctor", "--listen", "0.0.0.0:7777", "--no-such-flag"], ["doctor", "--pairs", "x"],
                                  ["probe", "10.0.0.1:5600", "--vllm"]])
def test_the_check_refuses_flags_the_cli_refuses(argv: list[str]) -> None:
    from pdcheck.errors import usage_error_types

    cmd = typer.main.get_command(app).get_command(None, argv[0])  # type: ignore[attr-defined]
    with pytest.raises(usage_error_types()):
        cmd.make_context(f"pdcheck {argv[0]}", argv[1:])
