"""pdcheck scenario from-logs: the seed's own log lines, and generated logs of other shapes and releases."""

from __future__ import annotations

import gzip
import random
import tomllib
from pathlib import Path

import pytest
from conftest import ROOT, SCENARIOS

from pdcheck.errors import BadInput
from pdcheck.vllm import fromlogs
from pdcheck.vllm.scenario import load

SEED_LOG = ROOT / "tests" / "data" / "seed-19338-workers.log"  # the 8 lines quoted in the #19341 thread
SEED_BLOCKS = [111680, 111488, 111488, 111488, 111488, 111488, 112448, 111488]
CYAN, RESET, GREEN = "\x1b[1;36m", "\x1b[0;0m", "\x1b[32m"


def _reg_091(rank: int, pid: int, nb: int, *, colour: bool = False, heads: int = 2) -> str:
    pre = f"(VllmWorker rank={rank} pid={pid})"
    if colour:
        pre = f"{CYAN}{pre}{RESET}"
    lvl = f"{GREEN}INFO{RESET}" if colour else "INFO"
    return (f"{pre} {lvl} 06-09 07:25:02 [nixl_connector.py:527] Registering KV_Caches: use_mla: False, "
            f"num_blocks: {nb}, block_shape: torch.Size([16, {heads}, 128]), "
            f"per_layer_kv_cache_shape: torch.Size([2, {nb}, 16, {heads}, 128])")


def _head_091(tp: int, engine_id: str, dp: int = 1) -> list[str]:
    return [
        "INFO 06-09 07:24:01 [api_server.py:1287] vLLM API server version 0.9.1",
        f"INFO 06-09 07:24:01 [cli_args.py:309] non-default args: {{'model': 'Qwen/Qwen3-8B', "
        f"'tensor_parallel_size': {tp}, 'data_parallel_size': {dp}, 'kv_transfer_config': "
        f"KVTransferConfig(kv_connector='NixlConnector', engine_id='{engine_id}', kv_buffer_device='cuda', "
        f"kv_buffer_size=1000000000.0, kv_role='kv_both', kv_rank=None, kv_parallel_size=1, "
        f"kv_ip='127.0.0.1', kv_port=14579, kv_connector_extra_config={{}}, kv_connector_module_path=None)}}",
        "INFO 06-09 07:24:09 [core.py:70] Initializing a V1 LLM engine (v0.9.1) with config: "
        "model='Qwen/Qwen3-8B', speculative_config=None, tokenizer='Qwen/Qwen3-8B', skip_tokenizer_init=False, "
        f"dtype=torch.float16, max_seq_len=40960, tensor_parallel_size={tp}, pipeline_parallel_size=1, "
        "disable_custom_all_reduce=False, quantization=None, enforce_eager=False, kv_cache_dtype=auto, "
        "device_config=cuda, seed=0, served_model_name=Qwen/Qwen3-8B",
        "WARNING 06-09 07:24:10 [utils.py:2671] some unrelated warning about NCCL",
    ]


def _parse(text: str, name: str = "x.log", dp_rank: int | None = None) -> fromlogs.LogFacts:
    return fromlogs.parse(fromlogs.split_lines(text), name, dp_rank)


# ------------------------------------------------------------------------------------------- pure parser
def test_seed_lines() -> None:
    facts = fromlogs.parse(fromlogs.read_log(SEED_LOG), "seed.log")
    v = {k: f.value for k, f in facts.fields.items()}
    assert v["tp_size"] == 8 and v["num_blocks"] == SEED_BLOCKS
    assert v["block_size"] == 16 and v["head_dim"] == 128 and v["kv_heads"] == 8 and v["use_mla"] is False
    assert "vllm" not in v and "dtype" not in v
    assert "rank:line 0:1" in facts.fields["num_blocks"].where


def test_seed_scenario_matches_the_bundled_seed() -> None:
    fl = fromlogs.from_files(SEED_LOG, SEED_LOG)
    seed = load(SCENARIOS / "seed-19338-tp8.toml")
    for side in ("prefill", "decode"):
        inst = fl.doc[side]
        ref = getattr(seed, side)
        assert (inst["tp_size"], inst["num_blocks"], inst["block_size"], inst["kv_heads"], inst["head_dim"]) == (
            ref.tp_size, ref.blocks(), ref.block_size, ref.kv_heads, ref.head_dim)
    missing = fromlogs.missing_report(fl, {})
    assert any(m.startswith("release:") and "--vllm" in m for m in missing)
    assert any(m.startswith("layers:") and "--layers" in m for m in missing)
    assert any(m.startswith("dtype:") and "--dtype" in m for m in missing)
    assert not any(m.startswith(("num_blocks", "tp_size", "kv_heads", "head_dim")) for m in missing)
    # a flag that supplies a field takes it off the report
    assert not any(m.startswith("dtype:") for m in fromlogs.missing_report(fl, {"prefill": {"dtype": "float16"},
                                                                                  "decode": {"dtype": "float16"}}))


def test_colour_noise_crlf_shuffled_ranks() -> None:
    blocks = [5808, 5800, 5800, 5816]
    regs = [_reg_091(r, 100 + r, nb, colour=True) for r, nb in enumerate(blocks)]
    random.Random(7).shuffle(regs)
    noise = [f"{CYAN}(VllmWorker rank=1 pid=101){RESET} INFO 06-09 07:25:01 [gpu_model_runner.py:1595] "
             "Model loading took 15.27 GiB", "Loading safetensors checkpoint shards: 100% Completed | 5/5",
             "\x1b[2K\rProcessed prompts:  50%|#####     | 1/2"]
    lines = _head_091(4, "prefill-abc")
    text = "\r\n".join([*lines[:2], regs[0], noise[0], *lines[2:], regs[1], noise[1], regs[2], noise[2], regs[3]])
    facts = _parse(text + "\r\n")
    v = {k: f.value for k, f in facts.fields.items()}
    assert v["num_blocks"] == blocks and v["tp_size"] == 4 and v["kv_heads"] == 8
    assert v["vllm"] == "0.9.1" and v["dtype"] == "float16" and v["engine_id"] == "prefill-abc"
    assert v["model"] == "Qwen/Qwen3-8B" and v["kv_connector"] == "NixlConnector"


def test_gzip_file(tmp_path: Path) -> None:
    text = "\n".join([*_head_091(2, "p"), _reg_091(1, 11, 70), _reg_091(0, 10, 64)]) + "\n"
    path = tmp_path / "p.log.gz"
    path.write_bytes(gzip.compress(text.encode()))
    facts = fromlogs.parse(fromlogs.read_log(path), path.name)
    assert facts.fields["num_blocks"].value == [64, 70]


def test_unlabelled_dp_workers_091() -> None:
    # 0.9.x workers carry no DP label: with data_parallel_size 2, the second process per rank is DP rank 1.
    regs = [_reg_091(0, 10, 100), _reg_091(0, 20, 200), _reg_091(1, 11, 101), _reg_091(1, 21, 201)]
    text = "\n".join([*_head_091(2, "p", dp=2), *regs])
    assert _parse(text).fields["num_blocks"].value == [100, 101]
    facts = _parse(text, dp_rank=1)
    assert facts.fields["num_blocks"].value == [200, 201] and facts.fields["dp_rank"].value == 1


def test_dp_label_from_an_outer_engine_core_prefix() -> None:
    regs = [f"{CYAN}(EngineCore_{dp} pid={9 + dp}){RESET} " + _reg_091(r, 10 + 10 * dp + r, 100 * (dp + 1) + r)
            for dp in (1, 0) for r in (1, 0)]
    facts = _parse("\n".join(regs))
    assert facts.fields["num_blocks"].value == [100, 101] and facts.dp_ranks == [0, 1]
    assert _parse("\n".join(regs), dp_rank=1).fields["num_blocks"].value == [200, 201]


def test_restart_in_one_log_uses_the_last_start() -> None:
    text = "\n".join([_reg_091(0, 10, 100), _reg_091(0, 30, 90)])
    facts = _parse(text)
    assert facts.fields["num_blocks"].value == [90] and any("restart" in n for n in facts.notes)


def test_release_0_10_1_mla_worker_names() -> None:
    lines = [f"{CYAN}(VllmWorker TP{r} pid={50 + r}){RESET} INFO 08-20 10:00:00 [nixl_connector.py:755] "
             f"Registering KV_Caches. use_mla: True, kv_buffer_device: cuda, use_host_buffer: False, "
             f"num_blocks: {nb}, block_shape: torch.Size([64, 576]), per_layer_kv_cache_shape: "
             f"torch.Size([{nb}, 64, 576])" for r, nb in ((1, 2992), (0, 3008))]
    lines.append(f"{CYAN}(VllmWorker TP0 pid=50){RESET} INFO 08-20 10:00:00 [cuda.py:220] "
                 "Using FlashMLA backend on V1 engine.")
    v = {k: f.value for k, f in _parse("\n".join(lines)).fields.items()}
    assert v["num_blocks"] == [3008, 2992] and v["use_mla"] is True
    assert v["block_size"] == 64 and v["head_dim"] == 576 and v["kv_heads"] == 1 and v["attn_backend"] == "FLASHMLA"


def _log_0_11_1(tokens: dict[int, int]) -> str:
    lines = ["(APIServer pid=1) INFO 11-18 09:00:00 [api_server.py:1977] vLLM API server version 0.11.1",
             "(APIServer pid=1) INFO 11-18 09:00:00 [utils.py:253] non-default args: {'model_tag': 'm/x', "
             "'model': 'm/x', 'tensor_parallel_size': 2, 'data_parallel_size': 2, 'block_size': 32, "
             "'kv_transfer_config': KVTransferConfig(kv_connector='NixlConnector', engine_id='d-1', "
             "kv_role='kv_both')}"]
    for dp, tok in tokens.items():
        for tp in (1, 0):
            lines.append(f"{CYAN}(Worker_DP{dp}_TP{tp} pid={100 + 10 * dp + tp}){RESET} INFO 11-18 09:00:05 "
                         "[nixl_connector.py:1138] Registering KV_Caches. use_mla: False, kv_buffer_device: cuda, "
                         "use_host_buffer: False")
        lines.append(f"{CYAN}(EngineCore_DP{dp} pid={90 + dp}){RESET} INFO 11-18 09:00:04 "
                     f"[kv_cache_utils.py:1229] GPU KV cache size: {tok:,} tokens")
    return "\n".join(lines)


def test_release_0_11_1_dp_ranks_from_the_kv_cache_size_line() -> None:
    text = _log_0_11_1({1: 1_200_000, 0: 1_234_560})
    facts = _parse(text)
    v = {k: f.value for k, f in facts.fields.items()}
    assert v["vllm"] == "0.11.1" and v["tp_size"] == 2 and v["block_size"] == 32 and v["dp_rank"] == 0
    assert v["num_blocks"] == 1_234_560 // 32 and v["engine_id"] == "d-1" and v["model"] == "m/x"
    assert "kv_heads" not in v and "head_dim" not in v
    assert any("exact" in n for n in facts.notes)
    assert _parse(text, dp_rank=1).fields["num_blocks"].value == 1_200_000 // 32
    with pytest.raises(BadInput, match="--dp-rank 5: the log has data-parallel ranks 0, 1"):
        _parse(text, dp_rank=5)


def test_release_0_34_merged_capacity_line_is_marked_approximate() -> None:
    text = "\n".join([
        "(APIServer pid=1) INFO 11-16 09:00:00 [startup.py:20] vLLM server version 0.34.0, serving model m/x",
        "(EngineCore pid=7) INFO 11-16 09:00:04 [kv_cache_utils.py:1168] GPU KV cache size: 100,000 tokens, "
        "Maximum concurrency for 32,768 tokens per request: 3.05x",
        "(EngineCore pid=7) INFO 11-16 09:00:01 [cuda.py:489] Using FLASH_ATTN backend.",
    ])
    facts = _parse(text)
    assert facts.fields["vllm"].value == "0.34.0" and facts.fields["num_blocks"].value == 100_000 // 16
    assert "approximate" in facts.fields["num_blocks"].where and "assumed" in facts.fields["num_blocks"].where
    assert facts.fields["attn_backend"].value == "FLASH_ATTN"


def test_missing_rank_line_is_bad_input() -> None:
    regs = [_reg_091(r, 10 + r, 64) for r in (0, 1, 3)]
    with pytest.raises(BadInput, match=r"x.log: no Registering KV_Caches line for TP rank\(s\) 2 \(tp_size 4"):
        _parse("\n".join([*_head_091(4, "p"), *regs]))


def test_cross_release_pair_and_toml_comments(tmp_path: Path) -> None:
    p = _parse("\n".join([*_head_091(2, "p-1"), _reg_091(0, 1, 64), _reg_091(1, 2, 64)]), "p.log")
    d = _parse(_log_0_11_1({0: 64 * 32}), "d.log")
    fl = fromlogs.build(p, d, "p.log", "d.log")
    assert fl.doc["vllm"] == ["0.11.1"] and fl.doc["prefill"]["vllm"] == "0.9.1"
    text = fromlogs.to_toml(fl, {"decode": {"kv_heads": 8}})
    doc = tomllib.loads(text)
    assert doc["decode"]["kv_heads"] == 8 and doc["prefill"]["num_blocks"] == [64, 64]
    assert "# from the command line (kv_heads)" in text
    assert "# from p.log: Registering KV_Caches num_blocks per TP rank" in text
    assert "# from d.log:" in text and "GPU KV cache size" in text
    # read on one side only: the other side takes it rather than a default that would differ (a false mismatch)
    assert fl.doc["decode"]["kv_heads"] == 4 and fl.doc["decode"]["head_dim"] == 128
    assert fl.doc["decode"]["dtype"] == "float16"
    assert any(m.startswith("head_dim: not in the decode log; the prefill log's value is used")
               for m in fromlogs.missing_report(fl, {}))
    path = tmp_path / "s.toml"
    path.write_text(text)
    sc = load(path)
    assert sc.prefill.blocks() == [64, 64] and sc.decode.blocks() == [64, 64] and sc.prefill.vllm == "0.9.1"


# ------------------------------------------------------------------------------------------- the command
def _write(tmp_path: Path, name: str, lines: list[str], *, gz: bool = False, crlf: bool = False) -> Path:
    text = ("\r\n" if crlf else "\n").join(lines) + "\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(text.encode()) if gz else text.encode())
    return path


def test_cli_writes_a_scenario_that_loads(pdcheck, tmp_path: Path) -> None:
    p = _write(tmp_path, "p.log.gz", [*_head_091(2, "p-eng"), _reg_091(1, 2, 70, colour=True),
                                      _reg_091(0, 1, 64, colour=True)], gz=True)
    d = _write(tmp_path, "d.log", [*_head_091(2, "d-eng"), _reg_091(0, 5, 60), _reg_091(1, 6, 60)], crlf=True)
    out = tmp_path / "s.toml"
    run = pdcheck("scenario", "from-logs", str(p), str(d), "-o", str(out), "--layers", "4")
    assert run.code == 0, run.err
    sc = load(out)
    assert sc.prefill.blocks() == [64, 70] and sc.decode.blocks() == [60, 60] and sc.vllm == ["0.9.1"]
    assert sc.prefill.engine_id == "p-eng" and sc.decode.dtype == "float16" and sc.decode.layers == 4
    assert "not in the logs" in run.err and "kv_cache_layout" in run.err and "--kv-cache-layout" in run.err
    assert "layers:" not in run.err  # given by a flag
    js = pdcheck("scenario", "from-logs", str(p), str(d), "--json")
    assert js.code == 0 and js.json()["scenario"]["prefill"]["num_blocks"] == [64, 70]
    assert any("kv_cache_layout" in m for m in js.json()["missing"])


def test_cli_unusable_logs_exit_2(pdcheck, tmp_path: Path) -> None:
    good = _write(tmp_path, "good.log", [_reg_091(0, 1, 64)])
    empty = _write(tmp_path, "noise.log", ["INFO 06-09 07:24:01 [api_server.py:1287] vLLM API server version 0.9.1",
                                           "some other line"])
    run = pdcheck("scenario", "from-logs", str(empty), str(good))
    assert run.code == 2 and "noise.log: no num_blocks" in run.err and "--prefill-blocks" in run.err
    assert "Traceback" not in run.err and len(run.err.strip().splitlines()) == 1
    # the flag it names makes the same logs usable
    run = pdcheck("scenario", "from-logs", str(empty), str(good), "--prefill-blocks", "64")
    assert run.code == 0, run.err and "num_blocks = 64" in run.out
    holes = _write(tmp_path, "holes.log", [*_head_091(4, "p"), _reg_091(0, 1, 64), _reg_091(3, 4, 64)])
    run = pdcheck("scenario", "from-logs", str(good), str(holes))
    assert run.code == 2 and "TP rank(s) 1, 2" in run.err
    run = pdcheck("scenario", "from-logs", str(tmp_path / "nope.log"), str(good))
    assert run.code == 2 and "nope.log: no such log file" in run.err
    bad_gz = tmp_path / "bad.log.gz"
    bad_gz.write_bytes(b"\x1f\x8b" + b"garbage")
    run = pdcheck("scenario", "from-logs", str(bad_gz), str(good))
    assert run.code == 2 and "not a readable gzip file" in run.err
    run = pdcheck("handshake", str(SCENARIOS / "seed-19338-tp8.toml"), "--from-logs", str(good), str(good))
    assert run.code == 2 and "not both" in run.err


def test_seed_lines_end_to_end_reproduce_the_seed_verdicts(pdcheck, tmp_path: Path) -> None:
    """from-logs on the thread's lines, then handshake: the verdicts the bundled seed scenario expects."""
    seed = tomllib.loads((SCENARIOS / "seed-19338-tp8.toml").read_text())
    releases = ",".join(seed["vllm"])
    out = tmp_path / "from-seed.toml"
    run = pdcheck("scenario", "from-logs", str(SEED_LOG), str(SEED_LOG), "-o", str(out))
    assert run.code == 0, run.err
    for args in ([str(out)], ["--from-logs", str(SEED_LOG), str(SEED_LOG)]):
        run = pdcheck("handshake", *args, "--vllm", releases, "--json")
        assert run.code == 1, run.err
        doc = run.json()
        for release in seed["vllm"]:
            exp = seed["expect"][release]
            assert doc["matrix"][release] == (exp if isinstance(exp, list) else [exp] * 8), release
        assert doc["fails"] == ["0.9.1"] and doc["fixed_in"] == "0.9.2"
        for d in doc["decode_ranks"]:  # the transfer proof as in the seed: 0.9.1's stride delivers wrong blocks
            assert d["transfer"]["corrected"]["wrong"] == 0
            if d["tp_rank"] != 0:
                assert d["transfer"]["0.9.1"]["wrong"] > 0 and d["transfer"]["0.9.1"]["stride"] == 111680


@pytest.mark.parametrize("chunk", [1, 3, 7, 1 << 20])
def test_read_log_streams_lines_as_splitlines_would(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     chunk: int) -> None:
    """Streaming in chunks of any size gives the lines (and line numbers) reading the file whole gave: CRLF, a lone
    CR, empty lines, ANSI colour, a last line without a newline; gzip the same."""
    text = "a\r\n\r\nb\x1b[32mc\x1b[0m\rd\n\n\te\x85f\nlast"
    monkeypatch.setattr(fromlogs, "_CHUNK", chunk)
    plain = tmp_path / "x.log"
    plain.write_bytes(text.encode())
    packed = tmp_path / "x.log.gz"
    packed.write_bytes(gzip.compress(text.encode()))
    want = fromlogs.split_lines(text)
    assert list(fromlogs.read_log(plain)) == want
    assert list(fromlogs.read_log(packed)) == want


def test_read_log_cuts_long_lines_and_refuses_past_the_caps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from pdcheck import bounds

    monkeypatch.setattr(fromlogs, "_CHUNK", 5)
    monkeypatch.setattr(bounds, "MAX_LOG_LINE", 4)
    log = tmp_path / "x.log"
    log.write_bytes(b"abcdefghij\nkl\nmnopqrstuvwxyz")
    assert list(fromlogs.read_log(log)) == ["abcd", "kl", "mnop"]  # the rest of a long line is skipped
    monkeypatch.setattr(bounds, "MAX_LOG_LINES", 1)
    with pytest.raises(BadInput, match="more than 1 lines"):
        list(fromlogs.read_log(log))
    monkeypatch.setattr(bounds, "MAX_LOG_LINES", 100)
    monkeypatch.setattr(bounds, "MAX_LOG_BYTES", 10)
    with pytest.raises(BadInput, match="more than 0 MiB"):
        list(fromlogs.read_log(log))


# ------------------------------------------------------------------------------------------- DP, PP, MLA, fp8
def _log_0_26(engine_id: str, *, dp: int = 2, tp: int = 2, pp: int = 1, tokens: int = 8192,
              cache: str = "auto", mla: bool = False, layout: str = "HND", debug_hash: bool = False) -> list[str]:
    """A 0.26.0-style start-up log of a DP x TP engine, lines as the wheel's format strings print them."""
    lines = ["(APIServer pid=1) INFO 11-18 09:00:00 [api_server.py:1977] vLLM API server version 0.26.0",
             f"(APIServer pid=1) INFO 11-18 09:00:00 [api_utils.py:273] non-default args: {{'model_tag': 'm/x', "
             f"'model': 'm/x', 'tensor_parallel_size': {tp}, 'data_parallel_size': {dp}, "
             + (f"'pipeline_parallel_size': {pp}, " if pp > 1 else "")
             + (f"'kv_cache_dtype': '{cache}', " if cache != "auto" else "")
             + f"'kv_transfer_config': KVTransferConfig(kv_connector='NixlConnector', engine_id='{engine_id}', "
             "kv_role='kv_both')}"]
    for d in range(dp):
        lines.append(f"{CYAN}(EngineCore_DP{d} pid={90 + d}){RESET} INFO 11-18 09:00:01 [core.py:117] Initializing a "
                     "V1 LLM engine (v0.26.0) with config: model='m/x', speculative_config=None, tokenizer='m/x', "
                     f"dtype=torch.bfloat16, max_seq_len=32768, tensor_parallel_size={tp}, "
                     f"pipeline_parallel_size={pp}, data_parallel_size={dp}, decode_context_parallel_size=1, "
                     f"quantization=None, enforce_eager=False, kv_cache_dtype={cache}, device_config=cuda")
        for t in range(tp):
            pre = f"{CYAN}(Worker_DP{d}_TP{t} pid={100 + 10 * d + t}){RESET} INFO 11-18 09:00:03"
            lines.append(f"{pre} [base_worker.py:506] Detected attention backend(s) "
                         f"['{'FLASHMLA' if mla else 'FLASH_ATTN'}']")
            lines.append(f"{pre} [base_worker.py:510] Detected kv cache layout {layout}")
            if debug_hash:
                lines.append(f"{pre.replace('INFO', 'DEBUG')} [metadata.py:132] NIXL compatibility hash: abc123 "
                             f"(model=m/x, dtype=torch.bfloat16, num_kv_heads=4, cache_dtype={cache}, "
                             f"attn_backend={'FLASHMLA' if mla else 'FLASH_ATTN'})")
            lines.append(f"{pre} [base_worker.py:1074] Registering KV_Caches. use_mla: {mla}, kv_buffer_device: "
                         "cuda, use_host_buffer: False")
        lines.append(f"{CYAN}(EngineCore_DP{d} pid={90 + d}){RESET} INFO 11-18 09:00:04 [kv_cache_utils.py:2177] "
                     f"GPU KV cache size: {tokens - 16 * d:,} tokens")
    return lines


def test_dp_pp_cache_dtype_layout_and_heads_from_a_0_26_log() -> None:
    text = "\n".join(_log_0_26("p", pp=2, cache="fp8_e4m3", debug_hash=True))
    v = {k: f.value for k, f in _parse(text).fields.items()}
    assert v["dp_size"] == 2 and v["pp_size"] == 2 and v["tp_size"] == 2 and v["cache_dtype"] == "fp8_e4m3"
    assert v["dtype"] == "fp8" and v["kv_cache_layout"] == "HND" and v["attn_backend"] == "FLASH_ATTN"
    assert v["kv_heads"] == 4 and v["use_mla"] is False and v["num_blocks"] == 8192 // 16


def test_0_18_to_0_20_bare_backend_line() -> None:
    """0.18 - 0.20 log the first backend's name alone, 0.21+ a list (read in the wheels): both give attn_backend."""
    pre = "(Worker_TP0 pid=5) INFO 01-01 00:00:00 [worker.py:318] "
    for line in ("Detected attention backend FLASHINFER", "Detected attention backend(s) ['FLASHINFER']"):
        facts = _parse("\n".join([pre + line, pre + "Detected kv cache layout NHD"]))
        assert facts.fields["attn_backend"].value == "FLASHINFER", line
        assert facts.fields["kv_cache_layout"].value == "NHD"


def test_mla_from_a_0_26_log_is_one_latent_head() -> None:
    facts = _parse("\n".join(_log_0_26("p", dp=1, mla=True)))
    v = {k: f.value for k, f in facts.fields.items()}
    assert v["use_mla"] is True and v["kv_heads"] == 1 and v["attn_backend"] == "FLASHMLA"
    # no Registering line: the MLA backend alone says it
    lines = [ln for ln in _log_0_26("p", dp=1, mla=True) if "Registering" not in ln]
    v = {k: f.value for k, f in _parse("\n".join(lines)).fields.items()}
    assert v["use_mla"] is True and v["kv_heads"] == 1


def test_enable_permute_local_kv_from_the_kv_transfer_config() -> None:
    lines = _log_0_26("d", dp=1)
    lines[1] = lines[1].replace("kv_role='kv_both')", "kv_role='kv_both', enable_permute_local_kv=True)")
    assert _parse("\n".join(lines)).fields["enable_permute_local_kv"].value is True
    assert "enable_permute_local_kv" not in _parse("\n".join(_log_0_26("d", dp=1))).fields


def test_unmodelled_cache_dtype_is_a_note_not_a_key() -> None:
    facts = _parse("\n".join(_log_0_26("p", dp=1, cache="fp8_inc")))
    assert "cache_dtype" not in facts.fields and any("fp8_inc" in n for n in facts.notes)


def test_fp8_ds_mla_becomes_the_modelled_key_with_its_geometry() -> None:
    # the compressed MLA cache (issue #17): a uint8 cache of one latent head of 656-byte rows
    facts = _parse("\n".join(_log_0_26("p", dp=1, cache="fp8_ds_mla", mla=True)))
    v = {k: f.value for k, f in facts.fields.items()}
    assert (v["cache_dtype"], v["dtype"], v["use_mla"], v["kv_heads"], v["head_dim"]) == (
        "fp8_ds_mla", "uint8", True, 1, 656)
    assert not any("fp8_ds_mla" in n for n in facts.notes)


def test_0_9_2_dp_size_from_the_non_default_args_only() -> None:
    # 0.9.2's engine config line has no data_parallel_size; its non-default args do
    text = "\n".join([*_head_091(2, "p", dp=2), _reg_091(0, 1, 64), _reg_091(1, 2, 64)])
    v = {k: f.value for k, f in _parse(text).fields.items()}
    assert v["dp_size"] == 2 and v["pp_size"] == 1 and v["cache_dtype"] == "auto"


def test_dp_log_writes_a_dp_scenario_whose_handshake_runs(pdcheck, tmp_path: Path) -> None:
    """DP 2 x TP 2 on both sides: the scenario runs every DP rank (no dp_rank key), and the handshake of every
    (DP rank, TP rank) pair passes with the transfer proof."""
    p = _write(tmp_path, "p.log", _log_0_26("p-eng", cache="fp8", debug_hash=True))
    d = _write(tmp_path, "d.log", _log_0_26("d-eng", cache="fp8", debug_hash=True))
    out = tmp_path / "s.toml"
    run = pdcheck("scenario", "from-logs", str(p), str(d), "-o", str(out), "--head-dim", "64")
    assert run.code == 0, run.err
    sc = load(out)
    assert sc.prefill.dp_size == 2 and sc.decode.dp_size == 2 and sc.prefill.cache_dtype == "fp8"
    assert sc.prefill.blocks() == [512, 512] and sc.decode.dp_rank == 0 and sc.vllm == ["0.26.0"]
    assert "dp_rank" not in tomllib.loads(out.read_text())["decode"]
    assert "every DP rank" in out.read_text()
    run = pdcheck("handshake", str(out), "--vllm", "0.26.0", "--json")
    assert run.code == 0, run.err + run.out
    doc = run.json()
    assert doc["matrix"]["0.26.0"] == ["ok"] * 4
    assert sorted((r["dp_rank"], r["tp_rank"]) for r in doc["decode_ranks"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert all(r["transfer"]["0.26.0"]["wrong"] == 0 for r in doc["decode_ranks"])
