#!/usr/bin/env bash
# One call on the lent GPU: environment, kernel precompile, the GPU test suite (with -n: the gpu_exclusive tests in a
# serial lane after the parallel run), then the named bench scripts.
#   bash bench/device_run.sh [--tests 'pytest args'] [--test-timeout S] [bench_name[:timeout_s[:args]] ...]
# Logs and JSON go to $OUT (or ./out). The CuPy kernel cache is carried in/out as .device/cupy_cache.tgz when present.
set -u
cd "$(dirname "$0")/.."
FINAL=${OUT:-$PWD/out}; OUT=$FINAL/r; mkdir -p "$OUT"   # everything lands in $FINAL/results.tgz (few files come back)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 FLAME_DEVICE=cuda HYPOTHESIS_PROFILE=ci
export CUPY_CACHE_DIR=/tmp/cupy_cache
# the commit the sender wrote (git rev-parse --short HEAD, + "+dirty") into .device/COMMIT: a copied tree's .git may
# not be the source's
[ -f .device/COMMIT ] && export FLAME_COMMIT=$(cat .device/COMMIT)
TESTS=""; TEST_TIMEOUT=360
while [ $# -gt 0 ]; do
  case "$1" in
    --tests) TESTS=$2; shift 2 ;;
    --test-timeout) TEST_TIMEOUT=$2; shift 2 ;;
    *) break ;;
  esac
done
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# the C extension (flame_core._speedups) as an install builds it: this tree runs from PYTHONPATH, not an install
python3 setup.py -q build_ext --inplace --force > "$OUT/build_ext.log" 2>&1 || { echo "build_ext failed:"; tail -5 "$OUT/build_ext.log"; }
python3 -c "from flame_core.memory import recycle; print('speedups:', recycle._c is not None)"
mkdir -p "$CUPY_CACHE_DIR"
[ -f .device/cupy_cache.tgz ] && tar xzf .device/cupy_cache.tgz -C "$CUPY_CACHE_DIR"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import cupy, numpy, torch; print('cupy', cupy.__version__, 'numpy', numpy.__version__, 'torch', torch.__version__)"
t0=$(date +%s)
python3 -m flame_core.kernels.precompile > "$OUT/precompile.log" 2>&1; grep -v " ok$" "$OUT/precompile.log" | tail -20
echo "precompile: $(( $(date +%s) - t0 )) s"
if [ "$TESTS" != "none" ]; then
  # with xdist workers (-n in the args) the tests that size their work from the GPU's free memory (marker
  # gpu_exclusive: budgets, auto_fit) would count the other workers' memory as theirs: the parallel run leaves them
  # out and a serial lane runs them after it (-n 0: in one process, alone on the GPU)
  LANE=""; case " $TESTS " in *" -n "*|*" -n="*|*" --numprocesses"*) LANE=1 ;; esac
  t0=$(date +%s)
  timeout "$TEST_TIMEOUT" python3 -m pytest -p no:cacheprovider -rfE --durations=15 $TESTS \
    ${LANE:+-m "not gpu_exclusive"} > "$OUT/pytest.log" 2>&1
  echo "pytest rc=$? in $(( $(date +%s) - t0 )) s"
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -60
  tail -3 "$OUT/pytest.log"
  if [ -n "$LANE" ]; then
    t0=$(date +%s)
    timeout "$TEST_TIMEOUT" python3 -m pytest -p no:cacheprovider -rfE $TESTS -n 0 -m gpu_exclusive \
      > "$OUT/pytest_exclusive.log" 2>&1
    echo "pytest (gpu_exclusive, serial) rc=$? in $(( $(date +%s) - t0 )) s"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest_exclusive.log" | head -30
    tail -3 "$OUT/pytest_exclusive.log"
  fi
fi
for spec in "$@"; do
  IFS=: read -r name tmo args <<< "$spec"
  t0=$(date +%s)
  echo "== bench/$name.py $args (timeout ${tmo:-300})"
  log="$OUT/$name.log"; i=1
  while [ -e "$log" ]; do i=$((i + 1)); log="$OUT/$name.$i.log"; done   # (a bench named twice: its own log each)
  OUT=$OUT timeout "${tmo:-300}" python3 "bench/$name.py" $args > "$log" 2>&1
  echo "rc=$? in $(( $(date +%s) - t0 )) s"
  tail -n 40 "$log"
done
tar czf "$FINAL/cupy_cache.tgz" -C "$CUPY_CACHE_DIR" . 2>/dev/null
tar czf "$FINAL/results.tgz" -C "$OUT" . && rm -rf "$OUT"
