#!/usr/bin/env bash
# The prepared GPU check: install eaglex (no dependencies) into this machine's Python, then run eaglex/gpu_check.py:
# the equivalence suite on the device in fp32, an 8B-shaped bf16 bench at batch 1 against transformers, vanilla vs
# EAGLE-3 in-flight batching at 1, 4 and 16 requests, the bf16 check with logit margins, and an attention
# micro-benchmark. Results go to $OUT (default ./build/gpu_check):
# results.json, report.txt, log.txt, pytest.xml, pytest.txt.
#
#   tools/gpu_check.sh                       # on the GPU machine (about 7 minutes on one H200)
#   tools/gpu_check.sh --device cpu --quick  # the dry run on a CPU (small models, a few minutes)
#
# Options: --device D, --quick, --budget SECONDS, --phases a,b, --no-peers, --no-flex (passed to the driver);
# --no-install uses the eaglex this Python already imports. Env: PYTHON (default python3), OUT, GPU_CHECK_WORK.
set -uo pipefail
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${OUT:-$REPO/build/gpu_check}
PY=${PYTHON:-python3}
case "$PY" in */*) PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY") ;; esac   # the driver runs from $WORK
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/eaglex-gpu-check}
INSTALL=1
ARGS=()
for a in "$@"; do
  if [ "$a" = "--no-install" ]; then INSTALL=0; else ARGS+=("$a"); fi
done
mkdir -p "$OUT" "$WORK"
OUT=$(cd "$OUT" && pwd)
exec > >(tee "$OUT/log.txt") 2>&1
echo "gpu_check: repo $REPO, out $OUT, work $WORK, python $($PY -c 'import sys; print(sys.executable, sys.version.split()[0])')"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
export EAGLEX_COMMIT=$(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo unknown)
if [ "$INSTALL" = 1 ]; then
  # Our pins do not apply here: the machine's torch/transformers/onnxruntime are used as they are.
  rm -rf "$WORK/site"
  t=$(date +%s)
  if ! "$PY" -m pip install --quiet --no-deps --no-build-isolation --no-index --target "$WORK/site" "$REPO"; then
    echo "gpu_check: installing eaglex failed"; exit 2
  fi
  export PYTHONPATH="$WORK/site${PYTHONPATH:+:$PYTHONPATH}"
  echo "gpu_check: installed eaglex into $WORK/site in $(( $(date +%s) - t )) s"
fi
cd "$WORK"    # not the repository root: its eaglex/ folder would shadow the installed package
"$PY" -m eaglex.gpu_check --repo "$REPO" --out "$OUT" --work "$WORK" ${ARGS[@]+"${ARGS[@]}"}
rc=$?
echo "gpu_check: exit $rc; results in $OUT"
exit $rc
