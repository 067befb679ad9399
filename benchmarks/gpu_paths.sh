#!/usr/bin/env bash
# The GPU-memory paths in one prepared run, for a machine with NVIDIA GPUs and pdcheck installed
# (docs/doctor.md, "GPU"): doctor's GPU checks, a handshake with the transfer proof on VRAM, and transfer-bench's
# READs between two ranks' VRAM. Without CUDA every step says SKIP or exits 2, and the script says so.
# Usage: bash benchmarks/gpu_paths.sh [OUT_DIR]    (each step's --json document is kept in OUT_DIR)
set -u
out=${1:-${OUT:-$(mktemp -d)}}
mkdir -p "$out"
py=${PYTHON:-python3}
status=0

step() {  # NAME EXPECTED_CODES COMMAND...: run one step, keep its document, say how it ended
    local name=$1 ok=$2
    shift 2
    local t0=$SECONDS
    timeout 300 "$@" > "$out/$name.json" 2> "$out/$name.err"
    local rc=$?
    if [[ " $ok " == *" $rc "* ]]; then
        echo "$name: exit $rc in $((SECONDS - t0)) s"
    else
        echo "$name: UNEXPECTED exit $rc in $((SECONDS - t0)) s: $(tail -n 1 "$out/$name.err")"
        status=1
    fi
}

if nvidia-smi -L 2>/dev/null; then hs=1 bench=0; else
    echo "no NVIDIA GPU: doctor's GPU checks SKIP and --device cuda is refused (exit 2)"; hs=2 bench=2
fi
step doctor "0 1" "$py" -m pdcheck doctor --json
# 0.9.1 asserts on uneven ranks (exit 1); corrected reads every block from VRAM and proves it.
step handshake "$hs" "$py" -m pdcheck handshake --prefill-tp 2 --decode-tp 2 \
    --prefill-blocks 5808,5800 --decode-blocks 5800 --vllm 0.9.1 --device cuda --json
step transfer-bench "$bench" "$py" -m pdcheck transfer-bench --device cuda --json

"$py" - "$out" <<'PY'
import json, pathlib, sys
out = pathlib.Path(sys.argv[1])
def load(name):
    try:
        return json.loads((out / f"{name}.json").read_text() or "null")
    except (OSError, ValueError):
        return None
doc = load("doctor")
if doc:
    for c in doc["checks"]:
        if "gpu" in c["name"].lower() or "cuda" in c["name"].lower():
            print(f"  doctor {c['name']}: {c['status']} {c['detail']}")
    for t in doc.get("transfers", []):
        print(f"  doctor transfer {t['memory']}: {t['blocks_checked']} blocks, {t['blocks_wrong']} wrong, "
              f"{t['gbps']:.1f} GB/s over {', '.join(t['data'])}")
hs = load("handshake")
if hs:
    for v in hs["verdicts"]:
        proof = v.get("proof") or {}
        print(f"  handshake {v['release']} {v['rank']}: {v['status']} (proof: {proof.get('blocks')} blocks, "
              f"{proof.get('wrong')} wrong)")
bench = load("transfer-bench")
if bench:
    print(f"  transfer-bench: exit {bench['exit_code']}, {len(bench.get('rows', []))} rows")
PY
echo "documents in $out"
exit $status
