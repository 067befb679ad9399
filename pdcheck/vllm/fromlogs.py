"""Read a scenario out of the start-up logs of a vLLM prefill and a decode instance.

Pure: text in, facts and a scenario document out (read_log is the only function that touches a file).
What each release line prints, as read from the release wheels (no vLLM code is used here):

* every release: `Initializing a V1 LLM engine (v<release>) with config: model='...', dtype=torch.<x>, ...,
  tensor_parallel_size=N, pipeline_parallel_size=N, [data_parallel_size=N (0.11+),] ... kv_cache_dtype=<x>, ...`;
  `vLLM API server version <release>` (up to 0.1x) or `vLLM server version <release>, serving model ...` (later);
  the API server's `non-default args: {...}` with tensor_parallel_size, pipeline_parallel_size, data_parallel_size,
  block_size, kv_cache_dtype and kv_transfer_config (0.9.2 prints data_parallel_size only there).
* 0.18+: per worker, INFO `Detected kv cache layout HND` (0.34: `LBHNC`/`LBNHC`; DEBUG before 0.18) and
  `Detected attention backend(s) ['FLASH_ATTN']` (0.18 - 0.20: `Detected attention backend FLASH_ATTN`; read in
  the wheels of 0.17.0 - 0.26.0). At DEBUG (0.14+): `NIXL compatibility hash: <h> (model=..,
  dtype=.., num_kv_heads=N, cache_dtype=.., attn_backend=..)`, N the model's total KV heads.
* 0.9.1 - 0.10.x: per worker, INFO `Registering KV_Caches: use_mla: .., num_blocks: N, block_shape:
  torch.Size([block_size, kv_heads_per_rank, head_dim]), per_layer_kv_cache_shape: torch.Size([...])`
  (0.10.1+: `Registering KV_Caches. use_mla: .., kv_buffer_device: .., use_host_buffer: .., num_blocks: ...`).
  That is each rank's *tensor* count, which is what the connector used (docs/vllm-protocol.md §4.1).
* 0.9.0: that line is DEBUG only. 0.11.0+: it no longer carries num_blocks or shapes. Those releases give the
  engine's logical count only, per engine: `GPU KV cache size: N tokens` (N = num_blocks * block_size;
  from about 0.3x `GPU KV cache size: N tokens, Maximum concurrency ...`, where N is derived from the
  concurrency and only approximates num_blocks * block_size).
* Worker prefixes: `(VllmWorker rank=R pid=P)` (0.9.x, 0.10.0), `(VllmWorker TP3 pid=P)` (0.10.1, 0.10.2),
  `(Worker_DP1_TP3 pid=P)` (0.11+); engine cores `(EngineCore_DP1 pid=P)`; prefixes are wrapped in ANSI colour.

Over the ~500 lines a module keeps to, on purpose: one reader per log line above, each next to the release
range it was read from; they fill one facts struct, and the scenario it becomes is written at the end.
"""

from __future__ import annotations

import dataclasses
import gzip
import re
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pdcheck import bounds
from pdcheck.errors import BadInput
from pdcheck.vllm.releases import mla_pages
from pdcheck.vllm.scenario import CACHE_DTYPES, LAYOUTS

ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_PREFIX = re.compile(r"\((?P<name>[A-Za-z_][\w ]*?(?: rank=\d+)?) pid=(?P<pid>\d+)\)")
_SIZE = r"torch\.Size\(\[(?P<{}>[\d, ]*)\]\)"
_REG_FULL = re.compile(
    r"Registering KV_Caches[:.] use_mla: (?P<mla>True|False),.*?num_blocks: (?P<nb>\d+), "
    r"block_shape: " + _SIZE.format("block") + r", per_layer_kv_cache_shape: " + _SIZE.format("layer"))
_REG_SHORT = re.compile(r"Registering KV_Caches[:.] use_mla: (?P<mla>True|False)")
_KV_SIZE = re.compile(r"(?:GPU|[A-Z]{2,}(?: \+ host)?) KV cache size: (?P<tokens>[\d,]+) tokens(?P<conc>, Maximum)?")
_ENGINE_INIT = re.compile(r"Initializing a V1 LLM engine \(v(?P<ver>[^)\s]+)\) with config: (?P<cfg>.*)")
_SERVER_VER = re.compile(r"vLLM (?:API )?server version (?P<ver>[0-9][\w.+-]*?)(?:,|\s|$)")
_NON_DEFAULT = re.compile(r"non-default args: (?P<args>\{.*\})")
_LAYOUT = re.compile(r"Detected kv cache layout (?P<layout>[A-Z]{3,6})\b")
# 0.21+: a list of the backends' names; 0.18 - 0.20: the first backend's name alone
_DETECTED_BACKEND = re.compile(r"Detected attention backend(?:\(s\) \[['\"]| )(?P<name>[A-Z0-9_]+)\b")
_COMPAT = re.compile(r"NIXL compatibility hash: \S+ \(model=(?P<model>.*?), dtype=(?P<dtype>[\w.]+), "
                     r"num_kv_heads=(?P<heads>\d+), cache_dtype=(?P<cache>\w+), attn_backend=(?P<backend>\w+)\)")
_BACKEND_09 = re.compile(r"Using (?P<name>Flash Attention|FlashInfer|FlashMLA|Triton MLA|Cutlass MLA|Triton|"
                         r"FlexAttenion|FlexAttention) backend")
_BACKEND = re.compile(r"Using (?:AttentionBackendEnum\.|_Backend\.)?(?P<name>[A-Z0-9_]*(?:ATTN|FLASH|MLA|TRITON|FLEX|"
                      r"SDPA|XFORMERS|TREE)[A-Z0-9_]*) (?:attention )?backend")
# 0.9.x prints a phrase; the connector compares get_name() of the backend class.
_BACKEND_NAMES = {"Flash Attention": "FLASH_ATTN_VLLM_V1", "FlashInfer": "FLASHINFER_VLLM_V1",
                  "FlashMLA": "FLASHMLA", "Triton MLA": "TRITON_MLA", "Cutlass MLA": "CUTLASS_MLA",
                  "Triton": "TRITON_ATTN_VLLM_V1", "FlexAttenion": "FLEX_ATTENTION",
                  "FlexAttention": "FLEX_ATTENTION"}
_TORCH_DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "half": "float16", "float32": "float32",
                 "float": "float32"}

# Scenario key -> the flag that supplies it when a log does not (per side: --prefill-X / --decode-X).
FLAG_FOR = {"num_blocks": "--{side}-blocks", "tp_size": "--{side}-tp", "block_size": "--block-size",
            "kv_heads": "--kv-heads", "head_dim": "--head-dim", "layers": "--layers", "dtype": "--dtype",
            "kv_cache_layout": "--kv-cache-layout", "attn_backend": "--attn-backend",
            "use_mla": "--use-mla/--no-mla", "engine_id": "--{side}-engine-id", "vllm": "--vllm"}


PER_SIDE_FLAGS = ("block_size", "kv_heads", "head_dim", "layers", "dtype", "kv_cache_layout", "attn_backend")


def read_log(path: Path) -> Iterator[str]:
    """Lines of a log file, plain or gzip, any line ending, ANSI colour removed, streamed and bounded
    (docs/reliability-untrusted.md): a regular file only (a FIFO, device or directory is refused before it is
    opened), at most MAX_LOG_BYTES after gzip inflation and MAX_LOG_LINES lines (more: BadInput), each line
    cut to its first MAX_LOG_LINE bytes. The checks run at once; lines are read as they are consumed."""
    fd = bounds.open_regular(path, "log file", "give a vLLM log file (plain or .gz)")
    return _lines(path, fd)


def _lines(path: Path, fd: int) -> Iterator[str]:
    import os

    raw = os.fdopen(fd, "rb")
    stream: Any = raw
    total = count = 0
    pending = b""  # the start of a line not ended yet (at most MAX_LOG_LINE bytes of it)
    skipping = False  # pending is full: drop bytes until the line ends
    try:
        if raw.peek(2)[:2] == b"\x1f\x8b":
            stream = gzip.GzipFile(fileobj=raw, mode="rb")
        while True:
            try:
                chunk = stream.read(_CHUNK)
            except (OSError, EOFError, zlib.error) as exc:
                raise BadInput(f"{path}: not a readable gzip file: {exc}") from None
            if not chunk:
                break
            total += len(chunk)
            if total > bounds.MAX_LOG_BYTES:
                raise BadInput(f"{path}: more than {bounds.MAX_LOG_BYTES >> 20} MiB{_inflated(stream, raw)}; pdcheck "
                               "reads a start-up log: keep its start (e.g. head -c 100M)")
            pieces = chunk.split(b"\n")
            for i, piece in enumerate(pieces):
                last = i == len(pieces) - 1
                if not skipping:
                    pending += piece[:bounds.MAX_LOG_LINE - len(pending)]
                    skipping = len(pending) >= bounds.MAX_LOG_LINE and last
                if last:
                    break
                count += 1
                if count > bounds.MAX_LOG_LINES:
                    raise BadInput(f"{path}: more than {bounds.MAX_LOG_LINES} lines{_inflated(stream, raw)}; "
                                   "pdcheck reads a start-up log: keep its start (e.g. head -n 100000)")
                yield from _decode(pending)
                pending, skipping = b"", False
        if pending:
            yield from _decode(pending)
    except OSError as exc:
        raise BadInput(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        raw.close()


_CHUNK = 1 << 20


def _inflated(stream: Any, raw: Any) -> str:
    return " after gzip inflation" if stream is not raw else ""


def _decode(line: bytes) -> Iterator[str]:
    """One newline-ended line as text: any other line break (\\r, \\r\\n, ...) splits it further, as
    str.splitlines does; an empty line stays one (empty) line, so line numbers match the file's."""
    text = line.decode("utf-8", errors="replace")
    if "\x1b" in text:
        text = ANSI.sub("", text)
    if text.isprintable():  # the common case: no other line break inside (splitlines' breaks are not printable)
        yield text
    else:
        yield from text.splitlines() or [""]


def split_lines(text: str) -> list[str]:
    return [ANSI.sub("", ln) for ln in text.splitlines()]


@dataclasses.dataclass(frozen=True)
class Found:
    value: Any
    where: str  # "P.log:12 (VllmWorker rank=0): Registering KV_Caches", for the TOML comment


@dataclasses.dataclass(frozen=True)
class Registration:
    """One worker's Registering KV_Caches line."""

    dp: int | None
    tp: int | None  # None: global rank still to be reduced modulo tp_size (0.9.x `rank=`)
    rank: int | None
    pid: int
    line: int
    use_mla: bool
    num_blocks: int | None
    block_shape: tuple[int, ...] | None


@dataclasses.dataclass
class LogFacts:
    """What one instance's log says. fields: scenario key (or 'vllm', 'dp_size', 'kv_connector') -> Found."""

    name: str
    fields: dict[str, Found] = dataclasses.field(default_factory=dict)
    notes: list[str] = dataclasses.field(default_factory=list)
    dp_ranks: list[int] = dataclasses.field(default_factory=list)


def _process(line: str) -> tuple[str, int | None, int | None, int | None, int | None]:
    """(label, dp, tp, global rank, pid) from the `(name pid=N)` prefixes of a line (there may be two)."""
    dp = tp = rank = pid = None
    label = ""
    for m in _PREFIX.finditer(line[:200]):
        name = m.group("name")
        label, pid = name, int(m.group("pid"))
        if (d := re.search(r"(?:_DP|EngineCore_(?:DP)?)(\d+)", name)) is not None:
            dp = int(d.group(1))
        if (t := re.search(r"TP(\d+)", name)) is not None:
            tp = int(t.group(1))
        if (r := re.search(r"rank=(\d+)", name)) is not None:
            rank = int(r.group(1))
        if name.startswith(("Worker", "VllmWorker")) and tp is None and rank is None:
            tp = 0  # 0.10.1+ names a single-rank worker without a TP suffix
    return label, dp, tp, rank, pid


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.replace(" ", "").split(",") if x)


def _arg(args: str, key: str) -> str | None:
    """A value out of the printed dict of non-default args (a Python repr)."""
    m = re.search(rf"['\"]{key}['\"]: (?P<v>'[^']*'|\"[^\"]*\"|[^,}}]+)", args)
    return m.group("v").strip().strip("'\"") if m else None


def _cfg(cfg: str, key: str) -> str | None:
    m = re.search(rf"(?:^|[ ,]){key}=(?P<v>'[^']*'|[^,]+)", cfg)
    return m.group("v").strip().strip("'") if m else None


def _kv_transfer(args: str) -> dict[str, str]:
    """kv_connector / engine_id / kv_role from KVTransferConfig(kv_connector='X', ...) or a dict."""
    m = re.search(r"kv_transfer_config['\"]?: (?P<v>.*)", args)
    if not m:
        return {}
    out = {}
    for key in ("kv_connector", "engine_id", "kv_role"):
        v = re.search(rf"['\"]?{key}['\"]?\s*[:=]\s*['\"](?P<v>[^'\"]*)['\"]", m.group("v"))
        if v:
            out[key] = v.group("v")
    # a KVTransferConfig field from 0.11.1 (its repr prints it; a JSON --kv-transfer-config may quote it)
    v = re.search(r"['\"]?enable_permute_local_kv['\"]?\s*[:=]\s*['\"]?(?P<v>True|False|true|false)", m.group("v"))
    if v:
        out["enable_permute_local_kv"] = v.group("v")
    return out


def parse(lines: Iterable[str], name: str, dp_rank: int | None = None) -> LogFacts:
    """Facts from one instance's start-up log. `dp_rank`: which data-parallel rank to read when the log has
    several (default: the lowest)."""
    facts = LogFacts(name)
    f = facts.fields
    regs: list[Registration] = []
    kv_sizes: dict[int | None, Found] = {}  # dp rank -> tokens
    backends: list[Found] = []

    def put(key: str, value: Any, n: int, label: str, what: str, *, first: bool = True) -> None:
        if first and key in f:
            return
        f[key] = Found(value, f"{name}:{n}{f' ({label})' if label else ''}: {what}")

    for n, line in enumerate(lines, 1):
        if "Registering KV_Caches" in line:
            label, dp, tp, rank, pid = _process(line)
            if (m := _REG_FULL.search(line)) is not None:
                regs.append(Registration(dp, tp, rank, pid or 0, n, m.group("mla") == "True", int(m.group("nb")),
                                         _ints(m.group("block"))))
            elif (m := _REG_SHORT.search(line)) is not None:
                regs.append(Registration(dp, tp, rank, pid or 0, n, m.group("mla") == "True", None, None))
        elif "KV cache size:" in line and (m := _KV_SIZE.search(line)) is not None:
            label, dp, _tp, _rank, _pid = _process(line)
            tokens = int(m.group("tokens").replace(",", ""))
            kv_sizes[dp] = Found((tokens, bool(m.group("conc"))), f"{name}:{n}{f' ({label})' if label else ''}: "
                                 f"{m.group(0).removesuffix(', Maximum')}")
        elif "LLM engine" in line and (m := _ENGINE_INIT.search(line)) is not None:
            label = _process(line)[0]
            put("vllm", m.group("ver"), n, label, f"Initializing a V1 LLM engine (v{m.group('ver')})")
            cfg = m.group("cfg")
            for key, skey in _SIZE_ARGS:
                if (v := _cfg(cfg, key)) is not None and v.isdigit():
                    put(skey, int(v), n, label, f"engine config {key}={v}")
            if (v := _cfg(cfg, "model")) is not None:
                put("model", v, n, label, f"engine config model={v!r}")
            kvd, dt = _cfg(cfg, "kv_cache_dtype"), _cfg(cfg, "dtype")
            if kvd:
                _cache_dtype(facts, kvd, f"{name}:{n}{f' ({label})' if label else ''}: engine config "
                             f"kv_cache_dtype={kvd}")
            if kvd == mla_pages.CACHE_DTYPE:  # a uint8 cache of 656-byte latent rows (STR_DTYPE_TO_TORCH_DTYPE)
                put("dtype", mla_pages.ELEMENT, n, label, f"engine config kv_cache_dtype={kvd} (a uint8 cache)")
            elif kvd and kvd != "auto":
                put("dtype", "fp8" if kvd.startswith("fp8") else _TORCH_DTYPES.get(kvd, kvd), n, label,
                    f"engine config kv_cache_dtype={kvd}")
            elif dt:
                put("dtype", _TORCH_DTYPES.get(dt.removeprefix("torch."), dt.removeprefix("torch.")), n, label,
                    f"engine config dtype={dt}, kv_cache_dtype={kvd or 'auto'} (the KV cache takes the model dtype)")
        elif "server version" in line and (m := _SERVER_VER.search(line)) is not None:
            put("vllm", m.group("ver"), n, _process(line)[0], f"vLLM server version {m.group('ver')}")
        elif "non-default args" in line and (m := _NON_DEFAULT.search(line)) is not None:
            args = m.group("args")
            label = _process(line)[0]
            for key, skey in (*_SIZE_ARGS, ("block_size", "block_size")):
                if (v := _arg(args, key)) is not None and v.isdigit():
                    put(skey, int(v), n, label, f"non-default args {key}={v}", first=False)
            if (v := _arg(args, "kv_cache_dtype")) is not None:
                _cache_dtype(facts, v, f"{name}:{n}{f' ({label})' if label else ''}: non-default args "
                             f"kv_cache_dtype={v!r}", first=False)
            for key in ("model", "model_tag"):
                if (v := _arg(args, key)) is not None and "model" not in f:
                    put("model", v, n, label, f"non-default args {key}={v!r}")
            for key, val in _kv_transfer(args).items():
                put(key, val.lower() == "true" if key == "enable_permute_local_kv" else val, n, label,
                    f"non-default args kv_transfer_config {key}={val!r}")
        elif "Detected kv cache layout" in line and (m := _LAYOUT.search(line)) is not None:
            label = _process(line)[0]
            lay = m.group("layout")
            if lay in LAYOUTS:
                put("kv_cache_layout", lay, n, label, f"Detected kv cache layout {lay}")
            else:
                facts.notes.append(f"line {n}: kv cache layout {lay!r} is not one pdcheck models ({', '.join(LAYOUTS)})")
        elif "NIXL compatibility hash" in line and (m := _COMPAT.search(line)) is not None:
            label = _process(line)[0]  # DEBUG (0.14+): the hash's own factors
            put("kv_heads", int(m.group("heads")), n, label, f"NIXL compatibility hash num_kv_heads={m.group('heads')}")
            _cache_dtype(facts, m.group("cache"), f"{name}:{n}{f' ({label})' if label else ''}: NIXL compatibility "
                         f"hash cache_dtype={m.group('cache')}")
            backends.append(Found(m.group("backend"), f"{name}:{n}: NIXL compatibility hash attn_backend="
                                  f"{m.group('backend')}"))
        elif "Detected attention backend" in line and (m := _DETECTED_BACKEND.search(line)) is not None:
            backends.append(Found(m.group("name"), f"{name}:{n}: Detected attention backend {m.group('name')}"))
        elif "backend" in line and (m := _BACKEND_09.search(line) or _BACKEND.search(line)) is not None:
            nm = m.group("name")
            backends.append(Found(_BACKEND_NAMES.get(nm, nm), f"{name}:{n}: Using {nm} backend"))

    if backends:
        f.setdefault("attn_backend", backends[0])
        if "MLA" in backends[0].value and not regs:  # an MLA backend serves MLA models only
            f["use_mla"] = Found(True, backends[0].where + " (an MLA backend)")
            f.setdefault("kv_heads", Found(1, backends[0].where + " (MLA: one latent head)"))
    _registrations(facts, regs, dp_rank)
    _kv_size(facts, kv_sizes, dp_rank)
    return facts


_SIZE_ARGS = (("tensor_parallel_size", "tp_size"), ("pipeline_parallel_size", "pp_size"),
              ("data_parallel_size", "dp_size"))


def _cache_dtype(facts: LogFacts, value: str, where: str, *, first: bool = True) -> None:
    """--kv-cache-dtype as written (a compat-hash factor from 0.13, so 'fp8' and 'fp8_e4m3' differ); one pdcheck
    does not model (fp8_inc, nvfp4_ds_mla, ...) becomes a note and stays out of the scenario. fp8_ds_mla fixes
    the cache's geometry: an MLA cache of one latent head of 656-byte uint8 rows (releases.mla_pages)."""
    if first and "cache_dtype" in facts.fields:
        return
    if value in CACHE_DTYPES:
        facts.fields["cache_dtype"] = Found(value, where)
        if value == mla_pages.CACHE_DTYPE:
            why = f"{where} ({value}: one latent head of {mla_pages.ROW_BYTES}-byte {mla_pages.ELEMENT} rows)"
            for key, val in (("use_mla", True), ("kv_heads", 1), ("head_dim", mla_pages.ROW_BYTES),
                             ("dtype", mla_pages.ELEMENT)):
                facts.fields.setdefault(key, Found(val, why))
    elif not any(value in n for n in facts.notes):
        facts.notes.append(f"kv_cache_dtype {value!r} ({where.split(': ', 1)[0]}) is not one pdcheck models "
                           f"({', '.join(CACHE_DTYPES)}): cache_dtype left out")


def _pick_dp(facts: LogFacts, seen: set[int | None], dp_rank: int | None) -> int | None:
    labelled = sorted(d for d in seen if d is not None)
    if not labelled:
        return None
    facts.dp_ranks = labelled
    want = labelled[0] if dp_rank is None else dp_rank
    if want not in labelled:
        raise BadInput(f"{facts.name}: --dp-rank {want}: the log has data-parallel ranks "
                       f"{', '.join(map(str, labelled))}")
    return want


def _registrations(facts: LogFacts, regs: list[Registration], dp_rank: int | None) -> None:
    if not regs:
        return
    f = facts.fields
    dp = _pick_dp(facts, {r.dp for r in regs}, dp_rank)
    if dp is not None:
        regs = [r for r in regs if r.dp == dp]
        f["dp_rank"] = Found(dp, f"{facts.name}: worker prefixes (data-parallel ranks {facts.dp_ranks})")
    tp_size = f["tp_size"].value if "tp_size" in f else None
    by_rank: dict[int, list[Registration]] = {}
    for r in regs:
        tp = r.tp if r.tp is not None else (r.rank % tp_size if tp_size and r.rank is not None else r.rank)
        by_rank.setdefault(tp if tp is not None else 0, []).append(r)
    dp_size = f["dp_size"].value if "dp_size" in f else 1
    chosen: dict[int, Registration] = {}
    for tp, rs in by_rank.items():
        pids = list(dict.fromkeys(r.pid for r in rs))
        if len(pids) > 1 and dp is None and dp_size > 1:
            # 0.9.x workers carry no DP label: the k-th process seen for a rank is taken as DP rank k.
            k = dp_rank or 0
            if k >= len(pids):
                raise BadInput(f"{facts.name}: --dp-rank {k}: TP rank {tp} registered from {len(pids)} processes")
            chosen[tp] = next(r for r in rs if r.pid == pids[k])
            if "dp_rank" not in f:
                f["dp_rank"] = Found(k, f"{facts.name}: data_parallel_size={dp_size} and unlabelled workers: "
                                     f"DP rank {k} = the {k + 1}. process seen per TP rank")
        else:
            chosen[tp] = rs[-1]  # a restart within one log: the last start-up counts
            if len(pids) > 1:
                facts.notes.append(f"TP rank {tp} registered from {len(pids)} processes (a restart?): "
                                   f"the last one (line {rs[-1].line}) is used")
    ranks = sorted(chosen)
    if tp_size is None:
        tp_size = ranks[-1] + 1
        f["tp_size"] = Found(tp_size, f"{facts.name}: highest TP rank in the Registering KV_Caches lines + 1")
    missing = [r for r in range(tp_size) if r not in chosen]
    if missing:
        have = ", ".join(map(str, ranks))
        raise BadInput(f"{facts.name}: no Registering KV_Caches line for TP rank(s) "
                       f"{', '.join(map(str, missing))} (tp_size {tp_size}; lines for ranks {have})")
    extra = [r for r in ranks if r >= tp_size]
    if extra:
        raise BadInput(f"{facts.name}: Registering KV_Caches lines for TP rank(s) {extra} but tp_size is {tp_size}")
    regs0 = [chosen[r] for r in range(tp_size)]
    lines = ", ".join(f"{r}:{c.line}" for r, c in enumerate(regs0))
    mla = {c.use_mla for c in regs0}
    f["use_mla"] = Found(regs0[0].use_mla, f"{facts.name}: Registering KV_Caches use_mla (rank:line {lines})")
    if len(mla) > 1:
        raise BadInput(f"{facts.name}: Registering KV_Caches lines disagree on use_mla")
    if regs0[0].num_blocks is None:
        facts.notes.append("Registering KV_Caches lines of this release carry no num_blocks or shapes")
        if regs0[0].use_mla:  # MLA caches one latent per token, replicated on every TP rank
            f["kv_heads"] = Found(1, f"{facts.name}: Registering KV_Caches use_mla: True (MLA: one latent head)")
        return
    f["num_blocks"] = Found([c.num_blocks for c in regs0],
                            f"{facts.name}: Registering KV_Caches num_blocks per TP rank (rank:line {lines})")
    shapes = {c.block_shape for c in regs0}
    if len(shapes) > 1:
        raise BadInput(f"{facts.name}: Registering KV_Caches block_shape differs between ranks: {sorted(shapes)}")
    shape = regs0[0].block_shape or ()
    where = f"{facts.name}:{regs0[0].line}: block_shape torch.Size({list(shape)})"
    if regs0[0].use_mla and len(shape) >= 2:  # [block_size, latent dim]: one replicated latent head
        f["block_size"] = Found(shape[-2], where)
        f["head_dim"] = Found(shape[-1], where)
        f["kv_heads"] = Found(1, where + " (MLA: one latent head)")
    elif len(shape) >= 3:  # [block_size, kv heads of this rank, head_dim]
        f["block_size"] = Found(shape[-3], where)
        f["head_dim"] = Found(shape[-1], where)
        f["kv_heads"] = Found(shape[-2] * tp_size, f"{where}: {shape[-2]} per rank x tp_size {tp_size}")


def _kv_size(facts: LogFacts, sizes: dict[int | None, Found], dp_rank: int | None) -> None:
    f = facts.fields
    if "num_blocks" in f or not sizes:
        return
    dp = _pick_dp(facts, set(sizes), dp_rank) if "dp_rank" not in f else f["dp_rank"].value
    found = sizes.get(dp) or next(iter(sizes.values()))
    if dp is not None and "dp_rank" not in f:
        f["dp_rank"] = Found(dp, f"{facts.name}: engine-core prefixes (data-parallel ranks {facts.dp_ranks})")
    tokens, approx = found.value
    bs = f["block_size"].value if "block_size" in f else 16
    blocks = tokens // bs
    how = f"{found.where} / block_size {bs}" + ("" if "block_size" in f else " (assumed: vLLM's CUDA default)")
    if approx:
        how += "; this release derives the figure from the max concurrency, so the count is approximate"
    f["num_blocks"] = Found(blocks, how)
    facts.notes.append("num_blocks is the engine's logical count (the minimum over its ranks), the same for every "
                       "rank; per-rank tensor counts are not in this release's INFO log" + _per_rank_note(facts))


def _per_rank_note(facts: LogFacts) -> str:
    ver = facts.fields.get("vllm")
    if ver is None:
        return ""
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", ver.value)
    if m and (int(m.group(1)), int(m.group(2)), int(m.group(3))) >= (0, 11, 1):
        return " (0.11.1+ shrinks every rank's tensors to that count, so it is exact)"
    return " (before 0.11.1 ranks could hold more: pass the real counts with --{side}-blocks if you know them)"


# ------------------------------------------------------------------------------------------- the scenario
SCENARIO_KEYS = ("tp_size", "dp_size", "pp_size", "num_blocks", "block_size", "layers", "kv_heads", "head_dim",
                 "dtype", "cache_dtype", "kv_cache_layout", "enable_permute_local_kv", "attn_backend", "use_mla", "dp_rank",
                 "model", "engine_id")
# Read when the log has them, the scenario default otherwise, and not worth a "missing" line (1 and auto are the
# defaults vLLM prints nothing else for).
OPTIONAL_KEYS = ("dp_rank", "model", "dp_size", "pp_size", "cache_dtype", "enable_permute_local_kv")
ALWAYS_MISSING = {"layers": "not logged by any release",
                  "kv_cache_layout": "not logged at INFO before 0.18 ('Detected kv cache layout')"}
# Keys P and D share when they serve one model: read on one side only, the other side takes that value
# rather than a default that would differ from it and raise a mismatch the deployment does not have.
SHARED_MODEL_KEYS = ("kv_heads", "head_dim", "dtype", "use_mla", "attn_backend", "model", "block_size")


@dataclasses.dataclass(frozen=True)
class FromLogs:
    doc: dict[str, Any]  # the scenario document (before flags)
    sources: dict[str, dict[str, str]]  # side -> key -> where it came from
    missing: dict[str, dict[str, str]]  # side -> key -> the flag that supplies it
    notes: dict[str, list[str]]


def build(p: LogFacts, d: LogFacts, p_path: str, d_path: str) -> FromLogs:
    """The scenario document from the two instances' facts. Unread keys stay out (the scenario defaults
    apply) and are listed in `missing` with the flag that sets them."""
    doc: dict[str, Any] = {"name": "from-logs",
                           "description": f"Written by pdcheck scenario from-logs from {p_path} (prefill) and "
                                          f"{d_path} (decode)."}
    sources: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}, "top": {}}
    missing: dict[str, dict[str, str]] = {"prefill": {}, "decode": {}, "top": {}}
    notes = {"prefill": [n.replace("{side}", "prefill") for n in p.notes],
             "decode": [n.replace("{side}", "decode") for n in d.notes]}
    for side, facts in (("prefill", p), ("decode", d)):
        inst: dict[str, Any] = {}
        for key in SCENARIO_KEYS:
            if key in facts.fields:
                inst[key] = facts.fields[key].value
                sources[side][key] = "from " + facts.fields[key].where
            elif key in OPTIONAL_KEYS:
                continue
            elif key == "engine_id":
                inst[key] = f"{side}-engine"
                sources[side][key] = "not in the log (no kv_transfer_config engine_id): a placeholder"
            else:
                missing[side][key] = ALWAYS_MISSING.get(key, "not in the log") + "; the scenario default is used"
        if inst.get("dp_size", 1) > 1 and "dp_rank" in inst:
            # every DP rank runs (scenario: dp_rank only with dp_size 1); they take the read rank's counts
            dp = inst.pop("dp_rank")
            sources[side].pop("dp_rank", None)
            notes[side].append(f"data_parallel_size {inst['dp_size']}: the scenario runs every DP rank, each with "
                               f"DP rank {dp}'s num_blocks and geometry (--dp-rank N reads another)")
        doc[side] = inst
    for side, other in (("prefill", "decode"), ("decode", "prefill")):
        for key in SHARED_MODEL_KEYS:
            if key not in doc[side] and key in doc[other] and key in sources[other]:
                doc[side][key] = doc[other][key]
                sources[side][key] = (f"not in the {side} log: the {other} log's value (P and D serve one model); "
                                      + sources[other][key])
                if key in missing[side]:
                    missing[side][key] = f"not in the {side} log; the {other} log's value is used"
    if "vllm" in d.fields:
        doc["vllm"] = [_release(d.fields["vllm"].value)]
        sources["top"]["vllm"] = "from " + d.fields["vllm"].where
    elif "vllm" in p.fields:
        doc["vllm"] = [_release(p.fields["vllm"].value)]
        sources["top"]["vllm"] = "from " + p.fields["vllm"].where + " (the decode log names none)"
    else:
        missing["top"]["vllm"] = "no version banner in either log"
    if "vllm" in p.fields and "vllm" in d.fields and _release(p.fields["vllm"].value) != doc["vllm"][0]:
        doc["prefill"]["vllm"] = _release(p.fields["vllm"].value)
        sources["prefill"]["vllm"] = "from " + p.fields["vllm"].where + " (a cross-release pair)"
    for side, facts in (("prefill", p), ("decode", d)):
        conn = facts.fields.get("kv_connector")
        if conn is not None and "Nixl" not in conn.value:
            notes[side].append(f"kv_transfer_config names {conn.value!r}, not NixlConnector: pdcheck models "
                               "NixlConnector only")
    return FromLogs(doc, sources, missing, notes)


def _release(text: str) -> str:
    """'0.9.1', '0.10.1.1' kept; '0.9.2.dev12+gabc' / '0.11.0rc1' -> the release line it belongs to."""
    m = re.match(r"(\d+\.\d+\.\d+(?:\.\d+)?)", text)
    return m.group(1) if m else text


def require(fl: FromLogs, overrides: dict[str, Any], p_path: str, d_path: str) -> None:
    """A log from which num_blocks cannot be read (and no flag gives it) is unusable: exit 2. One error names
    every flag needed, both sides' (a per-rank --X-blocks list also needs --X-tp when the log lacks tp_size)."""
    paths: list[str] = []
    flags: list[str] = []
    for side, path in (("prefill", p_path), ("decode", d_path)):
        given = overrides.get(side, {})
        if "num_blocks" in fl.missing[side] and "num_blocks" not in given:
            if path not in paths:
                paths.append(path)
            flags.append(f"--{side}-blocks N")
            if "tp_size" in fl.missing[side] and "tp_size" not in given:
                flags.append(f"--{side}-tp N")
    if flags:
        raise BadInput(f"{' and '.join(paths)}: no num_blocks: neither 'Registering KV_Caches ... num_blocks' lines "
                       f"(0.9.1-0.10.x) nor a 'GPU KV cache size: N tokens' line (is this a vLLM start-up log "
                       f"at INFO level?); pass {' '.join(flags)}")


def missing_report(fl: FromLogs, overrides: dict[str, Any]) -> list[str]:
    """One line per field read from neither log nor given by a flag: why, and the flag that sets it."""
    out = []
    if "vllm" in fl.missing["top"]:
        out.append(f"release: {fl.missing['top']['vllm']}; the scenario default (0.9.1) is used; set it with --vllm")
    keys = dict.fromkeys([*fl.missing["prefill"], *fl.missing["decode"]])
    for key in keys:
        sides = [s for s in ("prefill", "decode") if key in fl.missing[s] and key not in overrides.get(s, {})]
        if not sides:
            continue
        why = fl.missing[sides[0]][key]
        if key in PER_SIDE_FLAGS:
            flag = FLAG_FOR[key] + "".join(f" / --{s}-{key.replace('_', '-')}" for s in sides)
        else:
            flag = " / ".join(FLAG_FOR.get(key, f"--{key.replace('_', '-')}").format(side=s) for s in sides)
        where = "both logs" if len(sides) == 2 else f"the {sides[0]} log"
        out.append(f"{key}: {why} ({where}); set it with {flag}")
    return out


# ------------------------------------------------------------------------------------------- TOML
def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    from pdcheck.render.text import toml_string

    return toml_string(str(v))  # a log's text: its control characters escaped, never raw in the file


def _comment(text: str) -> str:
    from pdcheck.render.text import visible

    return "# " + visible(" ".join(text.split()))


def to_toml(fl: FromLogs, overrides: dict[str, Any] | None = None) -> str:
    """The scenario as commented TOML: each key says where it came from; unread keys are listed with the flag
    that sets them. Flag overrides (if any) are written in and marked as such."""
    overrides = overrides or {}
    out = ["# Scenario written by `pdcheck scenario from-logs`. Run it with: pdcheck handshake <this file>", ""]
    doc = fl.doc
    out.append(f"name = {_toml_value(doc['name'])}")
    out.append(f"description = {_toml_value(doc['description'])}")
    if "vllm" in doc:
        out.append(_comment(fl.sources["top"]["vllm"]))
        out.append(f"vllm = {_toml_value(doc['vllm'])}")
    else:
        out.append(_comment(f"vllm: {fl.missing['top']['vllm']}; give the release with --vllm (default 0.9.1)"))
    for side in ("prefill", "decode"):
        out += ["", f"[{side}]"]
        inst = dict(doc[side])
        flagged = overrides.get(side, {})
        for key in [*SCENARIO_KEYS, "vllm"]:
            if key in flagged:
                out.append(_comment(f"from the command line ({key})"))
                out.append(f"{key} = {_toml_value(flagged[key])}")
            elif key in inst:
                out.append(_comment(fl.sources[side][key]))
                out.append(f"{key} = {_toml_value(inst[key])}")
        unread = [k for k in fl.missing[side] if k not in flagged and k not in inst]
        if unread:
            out.append(_comment(f"not in the log, scenario defaults apply: {', '.join(unread)}"))
        for note in fl.notes[side]:
            out.append(_comment(f"note: {note}"))
    return "\n".join(out) + "\n"


def scenario_doc(fl: FromLogs, overrides: dict[str, Any]) -> dict[str, Any]:
    """The document to decode: the logs' values with flag overrides merged in (flags win)."""
    from pdcheck.scenariofile import merge

    return merge(fl.doc, overrides)


def from_files(prefill: Path, decode: Path, dp_rank: int | None = None) -> FromLogs:
    p_lines, d_lines = read_log(prefill), read_log(decode)  # both checked before either is read
    p = parse(p_lines, prefill.name, dp_rank)
    d = parse(d_lines, decode.name, dp_rank)
    return build(p, d, str(prefill), str(decode))
