"""Versions: pdcheck, the NIXL wheel(s), UCX, Python, torch, the CUDA driver, and the vLLM / SGLang releases
installed here with whether pdcheck models them. Nothing heavy is imported: package metadata and /proc only."""

from __future__ import annotations

import platform
from collections.abc import Sequence
from importlib import metadata

import msgspec

from pdcheck.doctor.model import Check, check
from pdcheck.errors import BadInput
from pdcheck.seam import Framework

NIXL_WHEELS = ("nixl-cu13", "nixl-cu12", "nixl")


class Versions(msgspec.Struct):
    pdcheck: str
    python: str
    nixl: dict[str, str]  # wheel -> version, every NIXL wheel installed
    ucx: str | None  # as the NIXL wheel's libucp reports it (filled by the plugin check)
    torch: str | None
    cuda_driver: str | None
    # framework name -> its installed release (None: not installed), for every registered framework
    frameworks: dict[str, str | None] = {}


def installed(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cuda_driver() -> str | None:
    """The NVIDIA kernel driver's version line, without loading libcuda or torch."""
    try:
        with open("/proc/driver/nvidia/version") as f:
            first = f.readline()
    except OSError:
        return None
    for word in first.split():
        if word.count(".") >= 1 and word.replace(".", "").isdigit():
            return word
    return first.strip() or None


def collect(frameworks: Sequence[Framework]) -> Versions:
    from pdcheck import __version__

    nixl = {w: v for w in NIXL_WHEELS if (v := installed(w)) is not None}
    return Versions(pdcheck=__version__, python=platform.python_version(), nixl=nixl, ucx=None,
                    torch=installed("torch"), cuda_driver=cuda_driver(),
                    frameworks={fw.name: installed(fw.distribution) for fw in frameworks if fw.distribution})


def checks(v: Versions, frameworks: Sequence[Framework]) -> list[Check]:
    out: list[Check] = []
    if not v.nixl:
        out.append(check("NIXL wheel", "FAIL", "no NIXL wheel is installed", "pip install nixl-cu13 (or nixl-cu12 "
                         "to match a CUDA 12 torch)"))
    elif len(v.nixl) > 1:
        out.append(check("NIXL wheel", "WARN", f"several NIXL builds installed: "
                         f"{', '.join(f'{k} {x}' for k, x in v.nixl.items())}; which one a framework imports "
                         "depends on its import order", "keep one: pip uninstall the build that does not match "
                         "your CUDA"))
    else:
        (k, x), = v.nixl.items()
        out.append(check("NIXL wheel", "PASS", f"{k} {x}"))
    drv = f"CUDA driver {v.cuda_driver}" if v.cuda_driver else "no NVIDIA driver"
    out.append(check("versions", "PASS", f"pdcheck {v.pdcheck}, Python {v.python}, torch {v.torch or 'absent'}, "
                     f"{drv}"))
    by_name = {fw.name: fw for fw in frameworks}
    out += [_framework(by_name[name], version) for name, version in v.frameworks.items()]
    return out


def _framework(fw: Framework, version: str | None) -> Check:
    label = f"{fw.title} release"
    if version is None:
        return check(label, "SKIP", f"{fw.title} is not installed here")
    try:
        line = fw.release_line(version)
    except BadInput as exc:
        return check(label, "WARN", f"{fw.title} {version}: pdcheck does not model it ({exc})",
                     f"reproduce with the nearest modelled release (pdcheck handshake {fw.flag} ...)")
    return check(label, "PASS", f"{fw.title} {version}, modelled by pdcheck as {line}")


def collect_fallback() -> Versions:
    """What is known without package metadata (the versions check overran its deadline)."""
    from pdcheck import __version__

    return Versions(__version__, platform.python_version(), {}, None, None, None)
