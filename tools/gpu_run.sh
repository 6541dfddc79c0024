#!/usr/bin/env bash
# Builds for sm_90 and runs, on a GPU machine, the stages named as arguments, logging to $OUT (or
# ./gpu-logs): tiers (tiers 1-3 under BITNET_STRICT_MODE=1), demo (--check, then the main job as
# JSON at batch 1 and 8, and their tables), bench (the GEMV, GEMM, RMSNorm and attention benchmarks),
# models (tier 3 of tests/test_models.py, then a full-size random checkpoint in 2B4T's layout:
# load to first token and generate's decode beside the demo's at the same shapes), issues (the open
# issues' figures in six files: the GEMM beside torch at 16-4096 tokens; the demo at batch 1, 8 and
# 64 and with a 4096-token prompt; then report.py prints their tables).
#   tools/gpu_run.sh tiers demo bench models
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
make -j16 CUDA_ARCHS=90 > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }
status=0
for stage in "$@"; do
    case $stage in
    tiers)
        BITNET_STRICT_MODE=1 python3 ci/tiers.py --tier auto -q -p no:cacheprovider \
            > "$out/tiers.log" 2>&1 || status=1
        tail -15 "$out/tiers.log" ;;
    demo)
        python3 -m bitnet_ffi demo --check 2>&1 | tee "$out/demo_check.log" | tail -3 || status=1
        for batch in 1 8; do
            python3 -m bitnet_ffi demo --json --batch "$batch" > "$out/demo_b$batch.json" \
                2>> "$out/demo.err" || status=1
        done
        python3 tools/report.py "$out/demo_b1.json" "$out/demo_b8.json" ;;
    bench)
        for op in gemv gemm rmsnorm attention; do
            python3 "tools/bench_$op.py" --json "$out/bench_$op.json" > "$out/bench_$op.log" 2>&1 \
                || status=1
            tail -5 "$out/bench_$op.log"
        done ;;
    models)
        BITNET_STRICT_MODE=1 python3 -m pytest tests/test_models.py -m gpu -q -p no:cacheprovider \
            -rs > "$out/models_tier3.log" 2>&1 || status=1
        tail -5 "$out/models_tier3.log"
        python3 tools/make_fixtures.py --full-size /tmp/bitnet-2b4t-random > "$out/full.log" 2>&1 \
            || { tail -5 "$out/full.log"; status=1; }
        python3 tools/bench_generate.py /tmp/bitnet-2b4t-random --json \
            > "$out/bench_generate.json" 2>> "$out/models.err" || status=1
        cat "$out/bench_generate.json"
        python3 -m bitnet_ffi demo --json --no-torch --prompt-len 960 --tokens 64 \
            > "$out/demo_same_shapes.json" 2>> "$out/models.err" || status=1
        python3 -c "import json, sys; print('demo decode ms/token:', \
json.load(open(sys.argv[1]))['decode_ms_per_token'])" "$out/demo_same_shapes.json" ;;
    issues)
        python3 tools/bench_gemm.py --tokens 16,64,128,256,960,4096 --json "$out/issues_gemm.json" \
            > "$out/issues.log" 2>&1 || status=1
        for case in "b1 --batch 1" "b8 --batch 8 --no-torch" "b64 --batch 64 --no-torch" \
            "p4096 --batch 1 --prompt-len 4096 --no-torch"; do
            python3 -m bitnet_ffi demo --json ${case#* } > "$out/issues_demo_${case%% *}.json" \
                2>> "$out/issues.log" || status=1
        done
        python3 tools/report.py "$out"/issues_gemm.json "$out"/issues_demo_{b1,b8,b64,p4096}.json ;;
    *) echo "unknown stage $stage"; status=1 ;;
    esac
done
exit $status
