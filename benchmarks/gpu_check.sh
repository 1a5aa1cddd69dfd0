#!/usr/bin/env bash
# The checks for a machine with a CUDA GPU, in one run (a lent GPU machine's time is short):
# the test suite (its `device` fixture adds "cuda" to every device-parametrised test), the
# `jacflow` command on the GPU, then the GPU benchmarks. Logs go to $OUT (default /tmp/gpu-out).
# Uses the python in $PYTHON (default python3) with torch already installed; the library comes
# from src/. TorchJD, for the benchmarks' comparisons, must be importable (on a machine without
# an index: wheels in .whl/, installed with --target and put on PYTHONPATH by the caller).
#
#   bash benchmarks/gpu_check.sh [tests|cli|autogram|solver|large|profile]...
# (default: the first four, in order; TEST_ARGS replaces the tests step's "tests src").
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-out}
PY=${PYTHON:-python3}
WORKERS=${WORKERS:-12}
mkdir -p "$OUT"
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
steps=("$@")
[ ${#steps[@]} -eq 0 ] && steps=(tests cli autogram solver)

"$PY" -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name())"
for step in "${steps[@]}"; do
    start=$SECONDS
    case $step in
    tests) # every test, in parallel workers (the benchmarks run after, on a quiet machine)
        timeout 240 "$PY" -m pytest -q -p no:benchmark -n "$WORKERS" -rfE ${TEST_ARGS:-tests src} \
            >"$OUT/tests.log" 2>&1
        echo "tests: exit $?"
        grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | cut -c1-160 | head -40
        tail -n 1 "$OUT/tests.log"
        ;;
    cli)
        timeout 40 "$PY" -m jacflow.cli train --device cuda --epochs 2 --quiet --no-plots \
            --out "$OUT/run" --overwrite >"$OUT/cli.log" 2>&1
        echo "cli: exit $?"
        tail -n 4 "$OUT/cli.log"
        rm -rf "$OUT/run"
        ;;
    autogram)
        timeout 170 "$PY" benchmarks/bench_autogram.py --device cuda --processes 0 \
            >"$OUT/autogram.log" 2>&1
        echo "autogram: exit $?"
        sed -n '/^Per-sample/,$p' "$OUT/autogram.log"
        ;;
    solver)
        timeout 70 "$PY" benchmarks/bench_upgrad_solver.py --device cuda --dtype float32 \
            --sizes 2 8 32 128 512 --torchjd-max-m 128 >"$OUT/solver.log" 2>&1
        echo "solver: exit $?"
        cat "$OUT/solver.log"
        ;;
    large) # a width at which the GPU's arithmetic starts to count
        timeout 200 "$PY" benchmarks/bench_autogram.py --device cuda --processes 0 \
            --only iwrm --models mlp4096 >"$OUT/large.log" 2>&1
        echo "large: exit $?"
        sed -n '/^Per-sample/,$p' "$OUT/large.log"
        ;;
    profile)
        timeout 120 "$PY" benchmarks/profile_gpu_step.py --table >"$OUT/profile.log" 2>&1
        echo "profile: exit $?"
        grep -v "^[-A-Za-z_ ]*  " "$OUT/profile.log" | grep -v "^-" | head -40
        ;;
    *)
        echo "unknown step $step: use tests, cli, autogram, solver, large or profile" >&2
        exit 2
        ;;
    esac
    echo "($step: $((SECONDS - start)) s)"
done
