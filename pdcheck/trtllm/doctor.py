"""`pdcheck doctor`'s rules for TensorRT-LLM's environment variables (docs/trtllm-protocol.md §9), each a pure rule
over the environment and the node's facts (context: pdcheck.doctor's Devices, or anything with `nics`).
pdcheck.seam.Framework.doctor_checks returns them; docs/trtllm.md, "doctor", says how to act on each."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdcheck.doctor.model import Check, check

BACKENDS = ("UCX", "LIBFABRIC")  # TRTLLM_NIXL_KVCACHE_BACKEND's accepted values (T57)
SELECTORS = ("TRTLLM_USE_NIXL_KVCACHE", "TRTLLM_USE_UCX_KVCACHE", "TRTLLM_USE_MOONCAKE_KVCACHE",
             "TRTLLM_USE_MPI_KVCACHE")  # backend: DEFAULT resolved by these (T14)


def use_py_nixl(env: Mapping[str, str]) -> Check:
    name = "env TRTLLM_USE_PY_NIXL_KVCACHE"
    v = env.get("TRTLLM_USE_PY_NIXL_KVCACHE")
    if v is None or v == "0":
        return check(name, "PASS", f"{'unset' if v is None else '0'}: the C++ binding NIXL agent where it loads (T40)")
    if v != "1":
        return check(name, "WARN", f"{v!r}: Invalid value for TRTLLM_USE_PY_NIXL_KVCACHE: {v}. Expected '0' or '1'. "
                     "Defaulting to '0'.", "set it to 0 or 1, alike on every ctx and gen")
    return check(name, "WARN", "1: the pure-Python NIXL agent; its transfer_engine_info is the raw NIXL blob, which a "
                 "peer on the C++ binding agent cannot load: registration fails on the ctx, only logged, and the gen "
                 "waits (T41)", "set TRTLLM_USE_PY_NIXL_KVCACHE alike on every ctx and gen (pdcheck handshake "
                 "trt-agent-skew shows the mismatch)")


def nixl_backend(env: Mapping[str, str]) -> Check:
    name = "env TRTLLM_NIXL_KVCACHE_BACKEND"
    v = env.get("TRTLLM_NIXL_KVCACHE_BACKEND")
    other = env.get("NIXL_BACKEND")
    if other is not None and v is not None:
        return check(name, "FAIL", f"{v} with NIXL_BACKEND={other} also set: trtllm#10024 (1.2.0rc5, LIBFABRIC) fails "
                     "with 'Deserialization of tag dest_data_ep_… failed … NIXL_ERR_BACKEND'",
                     "unset NIXL_BACKEND (not a TensorRT-LLM variable); TRTLLM_NIXL_KVCACHE_BACKEND picks the plugin")
    if other is not None:
        return check(name, "WARN", f"unset, NIXL_BACKEND={other}: TensorRT-LLM does not read NIXL_BACKEND; its C++ "
                     "agent uses UCX unless TRTLLM_NIXL_KVCACHE_BACKEND says otherwise (T57)",
                     f"export TRTLLM_NIXL_KVCACHE_BACKEND={other if other in BACKENDS else 'UCX'} and unset NIXL_BACKEND")
    if v is None:
        return check(name, "PASS", "unset: UCX (the C++ NIXL agent's default; 1.2.0rc2 hard-codes UCX, T56)")
    if v not in BACKENDS:
        return check(name, "WARN", f"{v!r}: Unsupported NIXL backend: {v}, fallback to UCX (T57)",
                     "set UCX or LIBFABRIC, alike on every ctx and gen")
    return check(name, "PASS", f"{v} (the C++ NIXL agent's plugin; the pure-Python agent always uses UCX, T42): set "
                 "it alike on every ctx and gen")


def _nics(context: Any) -> list[Any] | None:
    devs = getattr(context, "devices", context)
    nics = getattr(devs, "nics", None)
    return list(nics) if nics is not None else None


def nixl_interface(env: Mapping[str, str], context: Any) -> Check:
    name = "env TRTLLM_NIXL_INTERFACE"
    v = env.get("TRTLLM_NIXL_INTERFACE")
    wrong = env.get("TRTLLM_UCX_INTERFACE")
    if v is None:
        if wrong is not None:
            return check(name, "WARN", f"unset, TRTLLM_UCX_INTERFACE={wrong}: the C++ NIXL agent reads "
                         "TRTLLM_NIXL_INTERFACE; its 'No valid IP address found' error names TRTLLM_UCX_INTERFACE by "
                         "mistake (T56)", f"export TRTLLM_NIXL_INTERFACE={wrong}")
        return check(name, "PASS", "unset: the first IPv4 interface that is not lo or docker* is advertised (T56)")
    nics = _nics(context)
    if nics is None:
        return check(name, "PASS", f"{v} (this node's interfaces were not read)")
    nic = next((n for n in nics if n.name == v), None)
    if nic is None:
        return check(name, "FAIL", f"{v} does not exist on this node: the agent finds no IP and advertises "
                     "'UNKNOWN IP:port' (T56)", "name an interface this node has: ls /sys/class/net")
    ipv4 = [a for a in nic.addresses if "." in a]
    if nic.operstate == "down" or not ipv4:
        return check(name, "FAIL", f"{v} is {nic.operstate} with {'no IPv4 address' if not ipv4 else ', '.join(ipv4)}: "
                     "the agent advertises only an IPv4 address of it (T56, T57)",
                     "name an interface that is up and has an IPv4 address")
    return check(name, "PASS", f"{v}: up, advertises {ipv4[0]}")


def backend_selectors(env: Mapping[str, str]) -> Check:
    name = "env TRTLLM_USE_*_KVCACHE"
    on = [k for k in SELECTORS if env.get(k) == "1"]
    if not on:
        return check(name, "PASS", "none set: cache_transceiver_config.backend decides (T14)")
    if len(on) > 1:
        return check(name, "WARN", f"{', '.join(on)} all =1: backend DEFAULT picks one of them",
                     "set cache_transceiver_config.backend in the YAML and unset these")
    return check(name, "WARN", f"{on[0]}=1 is set, but it's recommended to set cache_transceiver_config.backend in "
                 "yaml config (T14)", f"set cache_transceiver_config.backend and unset {on[0]}")


def inflight_cancel(env: Mapping[str, str]) -> Check:
    name = "env TRTLLM_DISAGG_ENABLE_INFLIGHT_CANCEL"
    if env.get("TRTLLM_DISAGG_ENABLE_INFLIGHT_CANCEL") != "1":
        return check(name, "PASS", "unset: no in-flight cancellation")
    bad = [f"{k}={env[k]}" for k in ("TRTLLM_DISABLE_KV_CACHE_TRANSFER_OVERLAP", "TRTLLM_DISAGG_LAYERWISE",
                                       "TRTLLM_TRY_ZCOPY_FOR_KVCACHE_TRANSFER") if env.get(k) == "1"]
    if env.get("TRTLLM_NIXL_KVCACHE_BACKEND", "UCX") != "UCX":
        bad.append(f"TRTLLM_NIXL_KVCACHE_BACKEND={env['TRTLLM_NIXL_KVCACHE_BACKEND']}")
    if bad:
        return check(name, "FAIL", f"1 with {', '.join(bad)}: the transceiver factory raises ValueError (in-flight "
                     "cancel needs the C++ runtime, NIXL over UCX, a finite timeout, overlap on, layer-wise and "
                     "zero-copy off)", "unset TRTLLM_DISAGG_ENABLE_INFLIGHT_CANCEL or the variables named")
    return check(name, "PASS", "1: also needs transceiver_runtime CPP, backend NIXL and a finite "
                 "kv_transfer_timeout_ms in the YAML (not visible here)")


def ucx_hints(env: Mapping[str, str]) -> Check:
    """The variables TensorRT-LLM's UCX hint names (T14); UCX_NET_DEVICES has doctor's own check."""
    name = "env UCX_CUDA_IPC_ENABLE_MNNVL, UCX_RNDV_SCHEME"
    have = {k: env.get(k) for k in ("UCX_CUDA_IPC_ENABLE_MNNVL", "UCX_RNDV_SCHEME")}
    said = ", ".join(f"{k}={v}" if v is not None else f"{k} unset" for k, v in have.items())
    if have["UCX_RNDV_SCHEME"] not in (None, "put_zcopy", "auto"):
        return check(name, "WARN", f"{said}: TensorRT-LLM suggests UCX_RNDV_SCHEME=put_zcopy where ctx and gen devices "
                     "are not in one domain and transfers hang or run slow (T14)", "export UCX_RNDV_SCHEME=put_zcopy")
    return check(name, "PASS", f"{said} (TensorRT-LLM's hint on hangs across domains: UCX_CUDA_IPC_ENABLE_MNNVL=n, "
                 "UCX_RNDV_SCHEME=put_zcopy, UCX_NET_DEVICES unset, T14)")


def checks(env: Mapping[str, str], context: Any = None) -> list[Check]:
    """Every TensorRT-LLM rule, in a fixed order."""
    return [use_py_nixl(env), nixl_backend(env), nixl_interface(env, context), backend_selectors(env),
            inflight_cancel(env), ucx_hints(env)]
