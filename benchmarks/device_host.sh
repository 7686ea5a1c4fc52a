#!/usr/bin/env bash
# The accelerator machine's host CPU (a 16-core Xeon, AMX, no package registry) in one call of
# the device tool, within ~6.5 minutes: what issue 40 (scale) and issue 44 (quantized weights)
# ask of a many-core host. Everything it measures lands under $OUT (the tool brings it back):
#
#   host.txt            lscpu, the Python and torch there, baton's platform line, the levels
#   kernel-tests.log    the native kernels' tests at every level the host executes
#   scale.json/.log     benchmarks/scale.py: the 0.6B model at 16, 8, 4 and 2 threads (decode
#                       at batch 1 / 32 / 64, 32 mixed requests, prefill 512 / 2,048)
#   quantization.json   benchmarks/quantization.py: the 0.6B int8 / int4 / unquantized, speed
#
# Run it from the repository root with baton's dependencies the host lacks carried as wheels
# in .whl (benchmarks/README.md says how to fetch them): the device tool's
#   run(command="bash benchmarks/device_host.sh", carry=[".whl"], timeout_s=480)
# Each part has its own limit (seconds: SCALE_S, TESTS_S, QUANT_S), so a slow part costs
# only itself; SKIP_WHEELS=1 and PYTHON=... run it on another machine to try it out.
set -u
OUT=${OUT:-/tmp/device-host}
PY=${PYTHON:-python3}
SCALE_S=${SCALE_S:-170}
TESTS_S=${TESTS_S:-120}
QUANT_S=${QUANT_S:-75}
THREADS=${THREADS:-16,8,4,2}  # all cores first: a budget cut takes the fewest
mkdir -p "$OUT"
start=$(date +%s)
if [ "${SKIP_WHEELS:-0}" != 1 ] && compgen -G ".whl/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl ||
        { echo "error: the carried wheels did not install"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# baton from this tree (no install step there), the tests importable as a package
export PYTHONPATH=$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1 BATON_KERNEL_CACHE=${BATON_KERNEL_CACHE:-/tmp/baton-kernels}
stamp() { echo "[$(($(date +%s) - start)) s] $*" | tee -a "$OUT/steps.txt"; }

stamp "host facts"
{
    lscpu
    echo
    "$PY" -c 'import sys, torch
print(sys.version, "\ntorch", torch.__version__, "\n" + torch.__config__.show())'
    # every level's kernels built at once (one compiler each), the platform line
    "$PY" - <<'EOF'
from concurrent.futures import ThreadPoolExecutor

from baton import kernels, platform

levels = platform.current().runnable_levels()
with ThreadPoolExecutor(len(levels)) as pool:
    built = dict(zip(levels, pool.map(kernels.library_for, levels)))
print(platform.current().summary())
print("kernel levels:", {level: lib is not None for level, lib in built.items()})
EOF
} >"$OUT/host.txt" 2>&1
stamp "host facts done"

stamp "scale.py (limit ${SCALE_S} s)"
timeout "$SCALE_S" "$PY" benchmarks/scale.py --models qwen3-0.6b --threads "$THREADS" \
    --batches 1,32,64 --prompts 512,2048 --mixed 32 --budget-s $((SCALE_S - 25)) \
    --out "$OUT/scale.json" >"$OUT/scale.log" 2>&1
stamp "scale.py exit $?"

stamp "kernel tests (limit ${TESTS_S} s)"
workers=()
"$PY" -c 'import xdist' 2>/dev/null && workers=(-n 8)
timeout "$TESTS_S" "$PY" -m pytest -q -p no:cacheprovider "${workers[@]}" \
    tests/model/test_norm_kernel.py tests/model/test_native_layer.py \
    tests/engine/test_native_attention.py tests/engine/test_logits_kernel.py \
    tests/speculative/test_native_chain.py tests/model/test_quantization.py \
    tests/engine/test_kv_formats.py tests/model/test_int4_range.py >"$OUT/kernel-tests.log" 2>&1
stamp "kernel tests exit $?"

stamp "quantization.py (limit ${QUANT_S} s)"  # one thread a physical core, as an engine
cores=$("$PY" -c 'from baton.cores import read_topology; print(read_topology().usable)')
timeout "$QUANT_S" "$PY" benchmarks/quantization.py --model qwen3-0.6b --skip-llama \
    --skip-quality --threads "$cores" --rounds 2 --repeats 1 --out "$OUT/quantization.json" \
    >"$OUT/quantization.log" 2>&1
stamp "quantization.py exit $?"
