#!/usr/bin/env bash
# GPU check: the benchmark rows that make sense on ONE accelerator, written as a
# BENCHMARKS.md section naming the device. Never a dependency of the tests.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]      (default: benchmarks/results/gpu-DATE)
#
# Runs with the Python on PATH ($PYTHON to choose), this checkout on PYTHONPATH (no
# install needed) and JAX_PLATFORMS=cuda. GPU_CHECK_ONLY="env train" runs only the
# parts named; GPU_CHECK_PART_LIMIT sets the seconds each part may take (150). Each part has its own time limit and a
# failed part is recorded and skipped, so one run always leaves a section:
#   1. environment: versions and the device;
#   2. bf16 against float32 step time (benchmarks/precision_bench.py), two presets;
#   3. `nnx-mpmd bench` on one mesh: host µs per stage task (no-op replay) against
#      the step's kernel time, and the pipelined step against the one-device jit;
#   4. `nnx-mpmd train` (GPT small, one mesh, no compile cache): first step (trace +
#      compile) and the median step; then `nnx-mpmd generate` from that run: tokens/s.
set -u
OUT_DIR=${1:-${OUT:-benchmarks/results/gpu-$(date +%Y%m%d-%H%M%S)}}
mkdir -p "$OUT_DIR"
PY=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export JAX_PLATFORMS=${JAX_PLATFORMS:-cuda}
LIMIT=${GPU_CHECK_PART_LIMIT:-150}
ONLY=${GPU_CHECK_ONLY:-}  # e.g. "env train generate": run only these parts

part() {  # part NAME CMD...: runs CMD under a time limit, output to NAME.log
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  echo "== $name: $*" | tee -a "$OUT_DIR/parts.txt"
  local t0=$SECONDS
  timeout -k 5 "$LIMIT" "$@" >"$OUT_DIR/$name.log" 2>&1
  local rc=$?
  echo "   $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT_DIR/parts.txt"
  tail -n 3 "$OUT_DIR/$name.log"
}

part env "$PY" -c "import jax, flax, optax; print('jax', jax.__version__, 'flax', flax.__version__, 'optax', optax.__version__); print('device', jax.devices()[0].device_kind, len(jax.devices()))"
part precision_small "$PY" benchmarks/precision_bench.py --preset small --seq 256 --batch 32 --microbatches 4 --num-meshes 1 --data 1 --rounds 3
part precision_124m "$PY" benchmarks/precision_bench.py --preset gpt2-124m --seq 512 --batch 16 --microbatches 4 --num-meshes 1 --data 1 --rounds 3
part bench "$PY" -m nnx_mpmd bench --presets tiny,small --schedules 1f1b --num-meshes 1 --data 1 --microbatches 8 --batch 64 --seq 64 --rounds 3 --first-step-repeats 1 --overhead-repeats 1 --markdown "$OUT_DIR/bench.md" --out "$OUT_DIR/bench.json" --quiet
part train "$PY" -m nnx_mpmd train --preset small --meshes 1 --data 1 --microbatches 4 --batch-size 32 --steps 30 --log-every 1 --ckpt-every 30 --sample-tokens 0 --no-compile-cache --run-dir "$OUT_DIR/run"
part generate "$PY" -m nnx_mpmd generate --run-dir "$OUT_DIR/run" --meshes 1 --data 1 --prompt "def " --max-tokens 200 --temperature 0

"$PY" - "$OUT_DIR" <<'PYEOF' | tee "$OUT_DIR/section.md"
import json, pathlib, re, statistics, sys
out = pathlib.Path(sys.argv[1])
def log(name):
    p = out / f"{name}.log"
    return p.read_text(errors="replace") if p.exists() else ""
env = log("env")
device = re.search(r"^device (.+)$", env, re.M)
versions = re.search(r"^(jax .+)$", env, re.M)
print(f"## One GPU: {device.group(1) if device else 'unknown device'}\n")
print(f"{versions.group(1) if versions else 'versions unknown'}; `bash benchmarks/gpu_check.sh`.\n")
rows = [l for n in ("precision_small", "precision_124m") for l in log(n).splitlines() if l.startswith("|")]
if rows:
    print("### bf16 against float32 (benchmarks/precision_bench.py)\n")
    header = [l for l in rows if "---" in l or "ms/step" in l]
    body = [l for l in rows if l not in header]
    print("\n".join(header[:2] + body) + "\n")
bench = out / "bench.md"
if bench.exists():
    print("### nnx-mpmd bench, one mesh\n")
    print(bench.read_text().strip() + "\n")
metrics = out / "run" / "metrics.jsonl"
if metrics.exists():
    recs = [json.loads(l) for l in metrics.read_text().splitlines() if l.strip()]
    first = recs[0]["step_s"]
    later = [r["step_s"] for r in recs[1:]] or [first]
    tps = statistics.median(r["tokens_per_s"] for r in recs[1:]) if len(recs) > 1 else 0
    print("### nnx-mpmd train, GPT small, one mesh, no compile cache\n")
    print("| first step (trace + compile) s | median step ms | tokens/s |\n|---|---|---|")
    print(f"| {first:.2f} | {1e3 * statistics.median(later):.1f} | {tps:,.0f} |\n")
gen = re.findall(r"^.*tok(?:ens)?/s.*$", log("generate"), re.M)
if gen:
    print("### nnx-mpmd generate, one device, greedy, 200 tokens\n")
    print(gen[-1].strip() + "\n")
failed = [l.strip() for l in (out / "parts.txt").read_text().splitlines() if "exit" in l and "exit 0 " not in l]
if failed:
    print("Parts that did not finish: " + "; ".join(failed) + "\n")
PYEOF
