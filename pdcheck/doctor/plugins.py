"""NIXL plugins: which the wheel ships (get_plugin_list), their parameters and memory types, and which
backends really come up here (create_backend with defaults). Probed in a forked child with a deadline: a
plugin that hangs or crashes while it initialises is reported, not inherited."""

from __future__ import annotations

import os
import time

import msgspec

from pdcheck.doctor.model import Check, check
from pdcheck.errors import HarnessError

NEEDED = "UCX"  # the backend vLLM's and SGLang's NIXL connectors create by default


class Plugin(msgspec.Struct):
    name: str
    loads: bool
    status: str  # "ok", or NIXL's status word (NIXL_ERR_BACKEND, NIXL_ERR_NOT_FOUND, ...)
    params: dict[str, str]
    mem_types: list[str]


class Probe(msgspec.Struct):
    plugins: list[Plugin]
    ucx: str | None  # libucp's version, loaded with the UCX backend


def probe_main(conn: object, spec: bytes) -> None:
    """In the forked child: list the plugins, create each backend once, send the Probe."""
    import logging

    from pdcheck.nixlagent import _status

    logging.getLogger("NIXL").setLevel(logging.CRITICAL)
    from nixl_cu13._api import nixl_agent, nixl_agent_config

    agent = nixl_agent("pdcheck-doctor-plugins", nixl_agent_config(
        enable_prog_thread=False, enable_listen_thread=False, backends=[]))
    out: list[Plugin] = []
    for name in sorted(agent.get_plugin_list()):
        params: dict[str, str] = {}
        mems: list[str] = []
        try:
            opts, mem_list = agent.agent.getPluginParams(name)
            params = {str(k): str(v) for k, v in dict(opts).items()}
            mems = [str(x).rsplit(".", 1)[-1] for x in mem_list]
        except Exception:  # noqa: BLE001 - NIXL_ERR_NOT_FOUND: the plugin's library did not load
            pass
        try:
            agent.create_backend(name, {})
            out.append(Plugin(name, True, "ok", params, mems))
        except Exception as exc:  # noqa: BLE001 - the bindings raise nixl*Error classes
            out.append(Plugin(name, False, _status(exc), params, mems))
    from pdcheck.bench.rank import ucx_version

    conn.send_bytes(msgspec.msgpack.encode(Probe(out, ucx_version())))  # type: ignore[attr-defined]


def probe(deadline_s: float) -> Probe:
    """The Probe from a child forked by pdcheck's launcher; HarnessError when it dies or overruns."""
    from pdcheck import lifecycle
    from pdcheck.launcher import Launcher

    log_dir = str(lifecycle.scratch_dir("pdcheck-doctor-"))
    lau = Launcher()
    try:
        rank = lau.start("P", 0, probe_main, b"", log=os.path.join(log_dir, "plugins.log"))
        t0 = time.monotonic()
        if not rank.conn.poll(deadline_s):
            code = rank.reap(0)
            if code is not None:
                raise HarnessError(f"the plugin probe {rank.ended()}: {_tail(log_dir)}")
            raise HarnessError(f"the plugin probe did not answer within {deadline_s:g} s")
        try:
            data = rank.conn.recv_bytes()
        except (EOFError, OSError):
            rank.reap(max(0.0, deadline_s - (time.monotonic() - t0)))
            raise HarnessError(f"the plugin probe {rank.ended()}: {_tail(log_dir)}") from None
        return msgspec.msgpack.decode(data, type=Probe)
    finally:
        lau.close()
        lifecycle.remove_scratch(log_dir)


def _tail(log_dir: str) -> str:
    try:
        with open(os.path.join(log_dir, "plugins.log"), errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return "no log"
    return lines[-1][:200] if lines else "no output"


def checks(p: Probe) -> list[Check]:
    up = [x.name for x in p.plugins if x.loads]
    down = [f"{x.name} ({x.status})" for x in p.plugins if not x.loads]
    detail = f"UCX {p.ucx or 'unknown'}; load: {', '.join(up) or 'none'}" + (f"; shipped but not usable here: {', '.join(down)}" if down else "")
    if NEEDED not in up:
        ucx = next((x for x in p.plugins if x.name == NEEDED), None)
        why = f"the UCX backend fails to come up ({ucx.status})" if ucx else "the wheel has no UCX plugin"
        return [check("NIXL plugins", "FAIL", f"{why}; {detail}",
                      "reinstall the NIXL wheel (pip install --force-reinstall nixl-cu13) and check NIXL_PLUGIN_DIR")]
    return [check("NIXL plugins", "PASS", detail)]
