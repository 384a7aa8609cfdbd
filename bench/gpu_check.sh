#!/usr/bin/env bash
# First checks on a CUDA machine, in at most ~12 minutes on one H200 (SKIP_INSTALL=1: no pip
# install; SKIP_SP=1: no sequence-parallel part); writes one JSON.
#
#   bench/gpu_check.sh [OUT.json]          # default: gpu_check.json in the repository root
#   PYTHON=/path/to/python bench/gpu_check.sh out.json
#   bench/gpu_check.sh --dry-run out.json  # no GPU: tiny shapes on the CPU, no install (checks the script)
#
# 1. installs the `gpu` extra (flash-attn, liger-kernel, nvidia-ml-py) into the current Python
#    (skipped when already importable; a failed install is recorded, the rest still runs)
# 2. runs the gpu-marked tests: fused kernels against the reference path and against the dense
#    GLIDE reference, forward and gradients, bf16 and fp32, and the tree verify's flash-attn prefix
#    (the same test bodies run on every CPU under the strict stand-ins of tests/standins)
# 3. measures a GLIDE training step at 8k to 64k tokens (the best attention rung the machine has) on a Qwen2.5-7B-shaped target (random
#    weights): tokens/s and peak memory next to the preflight's memory estimate
# 4. sequence parallelism (bench/bench_sp.py): one GLIDE step at 32k tokens, SP 1 on one rank vs
#    SP 2 on two ranks sharing the GPU (gloo): peak memory per rank, the loss of both, and the
#    preflight's estimates for 8B / 32B targets at 64k and 128k
set -uo pipefail

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/gpu_check.json}")"
PY="${PYTHON:-python}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
t_start=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - t_start ))s] $*"; }

# ---- 1. the gpu extra (at most 4 minutes)
install_rc=0
if [[ $DRY == 1 ]]; then
  install_status="skipped (dry run)"
elif [[ "${SKIP_INSTALL:-0}" == 1 ]]; then
  install_status="skipped (SKIP_INSTALL=1)"
elif "$PY" -c "import flash_attn, liger_kernel" 2>/dev/null; then
  install_status="already installed"
else
  say "installing the gpu extra"
  timeout 240 "$PY" -m pip install --quiet --retries 1 --timeout 15 "flash-attn>=2.6" "liger-kernel>=0.5" "nvidia-ml-py>=12" \
      --no-build-isolation >"$WORK/install.log" 2>&1
  install_rc=$?
  install_status=$([[ $install_rc == 0 ]] && echo "installed" || echo "failed (rc $install_rc): $(tail -n 3 "$WORK/install.log" | tr '\n' ' ')")
fi
say "gpu extra: $install_status"

# ---- 2. gpu-marked tests (at most 3.5 minutes; -rs: each skip with its reason)
if [[ $DRY == 1 ]]; then
  tests_rc=0; echo '{"skipped": "dry run"}' >"$WORK/tests.json"
else
  say "gpu-marked tests"
  timeout 210 "$PY" -m pytest -q -m gpu -rs -p no:cacheprovider --junitxml="$WORK/tests.xml" \
      tests/trainer/test_kernels.py tests/trainer/test_attention_ladder.py tests/trainer/test_reference_parity.py \
      tests/trainer/test_tree_decode.py \
      >"$WORK/tests.log" 2>&1
  tests_rc=$?
  tail -n 25 "$WORK/tests.log"
  "$PY" - "$WORK/tests.xml" >"$WORK/tests.json" <<'PYEOF'
import json, sys, xml.etree.ElementTree as ET
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:                                   # pytest was killed before writing it
    print(json.dumps({"error": f"no test report ({e})"})); sys.exit()
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = suite.findall("testcase")
failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
skipped = [c.get("name") for c in cases if c.find("skipped") is not None]
why = {c.get("name"): c.find("skipped").get("message") for c in cases if c.find("skipped") is not None}
print(json.dumps({"total": len(cases), "failed": failed, "skipped": len(skipped), "skip_reasons": why,
                  "passed": len(cases) - len(failed) - len(skipped)}))
PYEOF
fi

# ---- 3. the training step at 8k, 16k, 32k and 64k (at most 5.5 minutes)
say "GLIDE step benchmark"
if [[ $DRY == 1 ]]; then
  timeout 170 "$PY" bench/gpu_check.py --dry-run --out "$WORK/step.json"
else
  timeout 330 "$PY" bench/gpu_check.py --seq 8192 16384 32768 65536 --steps 2 --length-timeout 90 --out "$WORK/step.json"
fi
step_rc=$?

# ---- 4. sequence parallel: SP 1 vs SP 2 (at most 2.5 minutes)
say "sequence parallel SP 1 vs SP 2"
if [[ "${SKIP_SP:-0}" == 1 && $DRY == 0 ]]; then
  echo '{"skipped": "SKIP_SP=1"}' >"$WORK/sp.json"; true
elif [[ $DRY == 1 ]]; then
  timeout 150 "$PY" bench/bench_sp.py --device cpu --dims small --layers 1 --seq 64 --steps 1 --warmup 0 \
      --out "$WORK/sp.json" >"$WORK/sp.log" 2>&1
else
  timeout 150 "$PY" bench/bench_sp.py --device cuda --dims qwen7b --layers 4 --seq 32768 --steps 2 --timeout 70 \
      --out "$WORK/sp.json" >"$WORK/sp.log" 2>&1
fi
sp_rc=$?
tail -n 3 "$WORK/sp.log"

# ---- one JSON
"$PY" - "$OUT" "$WORK" "$install_status" "$tests_rc" "$step_rc" "$(( $(date +%s) - t_start ))" "$sp_rc" <<'PYEOF'
import json, sys
from pathlib import Path
out, work, install, tests_rc, step_rc, wall, sp_rc = sys.argv[1:]
work = Path(work)
def load(name):
    p = work / name
    try:
        return json.loads(p.read_text())
    except Exception as e:
        return {"error": f"{name} missing or unreadable ({e})"}
report = {"gpu_extra": install, "tests": {"rc": int(tests_rc), **load("tests.json")},
          "step": {"rc": int(step_rc), **load("step.json")},
          "sequence_parallel": {"rc": int(sp_rc), **load("sp.json")}, "wall_s": int(wall)}
Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"wrote {out}")
PYEOF
say "done"
[[ $tests_rc == 0 && $step_rc == 0 && $sp_rc == 0 ]]
