#!/usr/bin/env bash
# First checks on a CUDA machine, one command, at most ~8 minutes on one H200; writes one JSON.
# Installs nothing (compute nodes are often offline): it names what is missing and runs the rest.
#
#   bench/gpu_check.sh [OUT.json] [LOGDIR]          # default: gpu_check.json in the repository root
#   PYTHON=/path/to/python bench/gpu_check.sh out.json logs/
#   bench/gpu_check.sh --dry-run out.json           # no GPU: tiny shapes on the CPU (checks the script)
#   PARTS="doctor demo" bench/gpu_check.sh out.json  # some parts only (default: all five)
#   DEADLINE=600 bench/gpu_check.sh out.json         # the whole run's bound in seconds (default 480)
#
# An offline node gets longspec's needs as wheels built elsewhere (../shared/offline-gpu/wheelhouse.sh
# in the development tree; any `pip download` of the train extra for the node's Python will do).
#
# Parts, each bounded by its own timeout, each failure kept with the tail of its log:
#   doctor   `python -m longspec.doctor --json`: GPUs, CUDA, NCCL, DeepSpeed, arch list, kernels, disk
#   tests    the gpu-marked tests (kernels against the reference path, fused dispatch, tree decode);
#            a missing flash-attn or Liger skips with its reason
#   demo     `longspec demo --gpus 1`: the tiny preset's three stages through DeepSpeed and NCCL,
#            then eval of each (tau, speed-up)
#   sp       bench/bench_sp.py: SP 1 on one rank against SP 2 on two ranks sharing the GPU (memory)
#            (doctor then tests, sp and demo run side by side)
#   step     bench/gpu_check.py: one GLIDE step through the trainer's DeepSpeed engine on a
#            Qwen2.5-7B-shaped target at 8k..64k tokens: tokens/s, TFLOP/s, peak memory (allocated,
#            reserved, device) against the preflight's estimate; alone on the GPU, last
set -uo pipefail

DRY=0
if [[ "${1:-}" == "--dry-run" ]]; then DRY=1; shift; fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="$(realpath -m "${1:-$ROOT/gpu_check.json}")"
PY="${PYTHON:-python3}"
LOGS="${2:-}"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
[[ -n "$LOGS" ]] && mkdir -p "$LOGS" && LOGS="$(realpath "$LOGS")"
L="${LOGS:-$WORK}"    # each part's log, written as it runs (a run cut short keeps what it printed)
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
[[ $DRY == 1 ]] && export DS_ACCELERATOR=cpu CUDA_VISIBLE_DEVICES=""
# DeepSpeed's JIT ops go where longspec's launches put them (one folder per environment), not
# into torch's shared folder, where another environment's build (or a killed one's lock) waits.
TORCH_EXTENSIONS_DIR="${TORCH_EXTENSIONS_DIR:-$("$PY" -c 'from longspec.machine.opsdir import ops_build_dir; print(ops_build_dir())' 2>/dev/null)}"
[[ -n "$TORCH_EXTENSIONS_DIR" ]] && export TORCH_EXTENSIONS_DIR
t_start=$(date +%s)
say() { echo "[gpu_check $(( $(date +%s) - t_start ))s] $*"; }

PARTS=" ${PARTS:-doctor tests demo step sp} "
DEADLINE=${DEADLINE:-480}   # seconds for the whole script: each part's timeout is cut to fit
# part NAME TIMEOUT CMD...: runs CMD under TIMEOUT, its output in $WORK/NAME.log; writes NAME.part
part() {
  local name=$1 limit=$2; shift 2
  [[ "$PARTS" == *" $name "* ]] || { say "$name: not asked for"; return 0; }
  local left=$(( DEADLINE - ($(date +%s) - t_start) - 20 ))   # the JSON at the end always gets written
  (( left < 15 )) && { say "$name: no time left (DEADLINE=$DEADLINE s)"; echo "124 0 0" >"$WORK/$name.part"; return 124; }
  (( limit > left )) && limit=$left
  local t0; t0=$(date +%s)
  timeout --kill-after=10 "$limit" "$@" >"$L/$name.log" 2>&1
  local rc=$?
  echo "$rc $(( $(date +%s) - t0 )) $limit" >"$WORK/$name.part"
  say "$name: rc $rc in $(( $(date +%s) - t0 ))s"
  return $rc
}

# ---- what is missing (nothing is installed)
MISSING=$("$PY" - <<'PYEOF'
import importlib.util
need = ["torch", "transformers", "deepspeed", "hydra", "omegaconf", "ruamel.yaml", "typer", "rich", "psutil",
        "pyarrow", "pytest"]
print(" ".join(m for m in need if importlib.util.find_spec(m.split(".")[0]) is None
               or (m == "ruamel.yaml" and importlib.util.find_spec("ruamel.yaml") is None)))
PYEOF
)
OPTIONAL=$("$PY" -c "import importlib.util as u; print(' '.join(m for m in ('flash_attn', 'liger_kernel') if u.find_spec(m) is None))")
say "missing: ${MISSING:-nothing}; optional not installed: ${OPTIONAL:-none}"
echo "$MISSING" >"$WORK/missing.txt"; echo "$OPTIONAL" >"$WORK/optional.txt"
if [[ -n "$MISSING" ]]; then
  say "install these first (pip install --no-index --no-deps WHEELS/*.whl on an offline node); nothing more runs"
fi

if [[ -z "$MISSING" ]]; then
  # ---- three lanes side by side: doctor then the tests; SP 1 vs 2 (its memory, not its time); the demo
  (
    part doctor 60 "$PY" -m longspec.doctor --json --dir "$WORK"
    if [[ $DRY == 1 ]]; then
      part tests 120 "$PY" -m pytest -q -p no:cacheprovider tests/trainer/test_gpu_check.py -k parses
    else
      part tests 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs --junitxml="$WORK/tests.xml" \
          tests/trainer/test_kernels.py tests/trainer/test_attention_ladder.py tests/trainer/test_reference_parity.py \
          tests/trainer/test_tree_decode.py tests/trainer/test_fused_dispatch.py
    fi
  ) &
  tests_pid=$!
  (
    if [[ $DRY == 1 ]]; then
      part sp 120 "$PY" bench/bench_sp.py --device cpu --dims small --layers 1 --seq 64 --steps 1 --warmup 0 \
          --out "$WORK/sp.json"
    else   # each launch builds the target and compiles its kernels: about a minute
      part sp "${SP_TIMEOUT:-240}" "$PY" bench/bench_sp.py --device cuda --dims qwen7b --layers 4 --seq 32768 \
          --steps 1 --warmup 1 --timeout 110 --out "$WORK/sp.json"
    fi
  ) &
  sp_pid=$!
  DEMO_ARGS=(--gpus 1); [[ $DRY == 1 ]] && DEMO_ARGS=(--max-steps 2 --no-eval)
  part demo 330 "$PY" -m longspec_cli demo "$WORK/demo" "${DEMO_ARGS[@]}"
  [[ -d "$WORK/demo" ]] && "$PY" -m longspec_cli status "$WORK/demo" --json >"$WORK/status.json" 2>>"$L/demo.log"
  "$PY" - "$WORK" >"$WORK/demo.json" 2>>"$L/demo.log" <<'PYEOF'
import json, sys
from pathlib import Path
work = Path(sys.argv[1])
status = json.loads((work / "status.json").read_text())
out = {}
for st in status["stages"]:
    log = Path(st["output_dir"]) / "train.log"
    lines = log.read_text(errors="replace").splitlines() if log.is_file() else []
    out[st["name"]] = {k: st.get(k) for k in ("state", "steps", "tau", "speedup", "tree_tau", "sim_tau", "best_tau")}
    out[st["name"]]["start_lines"] = [l for l in lines if "kernels (" in l or "ZeRO-" in l][:2]
print(json.dumps(out))
PYEOF
  wait "$tests_pid" "$sp_pid"
  # ---- the GLIDE step, last and alone on the GPU (timed; the device's memory is its alone)
  if [[ $DRY == 1 ]]; then
    part step 170 "$PY" bench/gpu_check.py --dry-run --out "$WORK/step.json"
  else
    part step "${STEP_TIMEOUT:-200}" "$PY" bench/gpu_check.py --seq 8192 16384 32768 65536 --steps 2 --warmup 1 \
        --length-timeout 60 --out "$WORK/step.json"
  fi
fi

# ---- one JSON
"$PY" - "$OUT" "$WORK" "$(( $(date +%s) - t_start ))" "$DRY" "$L" <<'PYEOF'
import json, sys
import xml.etree.ElementTree as ET
from pathlib import Path
out, work, wall, dry, logs = sys.argv[1:]
work, logs = Path(work), Path(logs)

def load(name):
    return json_line(work / name)

def json_line(path):
    """A JSON file, or the last line of a log that is a JSON object."""
    name = path.name
    try:
        text = path.read_text()
    except OSError as e:
        return {"error": f"{name} missing ({e.strerror})"}
    try:
        return json.loads(text)
    except ValueError:
        for line in reversed(text.splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    pass
    return {"error": f"{name} holds no JSON"}

def rows(path):
    """The JSON rows a part printed before it was cut short."""
    out = []
    for line in (path.read_text(errors="replace").splitlines() if path.is_file() else []):
        if line.startswith("{"):
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
    return out

def part(name, extra=None):
    p = work / f"{name}.part"
    if not p.is_file():
        return {"ran": False}
    rc, wall_s, limit = map(int, p.read_text().split())
    row = {"rc": rc, "wall_s": wall_s, "timeout_s": limit, "timed_out": rc in (124, 137)}
    if rc != 0:
        log = (logs / f"{name}.log").read_text(errors="replace").splitlines()
        row["log_tail"] = log[-25:]
    if extra:
        row.update(extra)
    return row

def tests():
    try:
        root = ET.parse(work / "tests.xml").getroot()
    except Exception:
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    cases = suite.findall("testcase")
    failed = [c.get("name") for c in cases if c.find("failure") is not None or c.find("error") is not None]
    skips = {}
    for c in cases:
        s = c.find("skipped")
        if s is not None:
            why = (s.get("message") or "").strip()
            skips[why] = skips.get(why, 0) + 1
    return {"total": len(cases), "passed": len(cases) - len(failed) - sum(skips.values()), "failed": failed,
            "skipped": skips}

missing = (work / "missing.txt").read_text().split() if (work / "missing.txt").is_file() else []
report = {
    "dry_run": dry == "1", "wall_s": int(wall),
    "missing": missing, "optional_missing": (work / "optional.txt").read_text().split(),
    "doctor": part("doctor", {"report": json_line(logs / "doctor.log")}),
    "tests": part("tests", tests()),
    "demo": part("demo", {"stages": load("demo.json")}),
    "step": part("step", load("step.json") if (work / "step.json").is_file() else {"rows_printed": rows(logs / "step.log")}),
    "sequence_parallel": part("sp", load("sp.json") if (work / "sp.json").is_file() else None),
}
ok = not missing and all(report[k].get("rc", 0) == 0 for k in ("doctor", "tests", "demo", "step", "sequence_parallel"))
report["ok"] = ok
Path(out).write_text(json.dumps(report, indent=2) + "\n")
print(f"wrote {out}: {'all parts passed' if ok else 'some parts failed (see rc and log_tail)'}")
sys.exit(0 if ok else 1)
PYEOF
