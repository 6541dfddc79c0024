#!/usr/bin/env bash
# A/B of CUDA kernel variants on a GPU machine; logs and JSON under $OUT/ab (or ./gpu-logs/ab).
# A variant is a whole replacement of SOURCE, one file of native/src/cuda; "main" is SOURCE as the
# tree has it. Every build is made the same way: the tree's sm_90 build, copied to /tmp/ab/NAME
# with the one source replaced, and rebuilt. The tests in AB_TESTS (pytest arguments, strict mode)
# run on each variant; then AB_TIME times every build in turn, each in a process of its own, ROUNDS
# times with the order rotated each round. The last lines are the table of min-max µs per variant
# (tools/report.py --ab), for the log entry (docs/log/).
#   tools/dev/ab_variants.sh SOURCE ROUNDS VARIANT.cu ...
#   AB_TESTS="tests/test_attention.py -m gpu -k decode" \
#       tools/dev/ab_variants.sh native/src/cuda/attention_decode.cu 3 lazy.cu pf1.cu
# AB_TIME runs with BITNET_LIB set to the build and `--json PATH` appended; its default times the
# decode cases below with bench_attention.py, without torch. For the GEMV, for example:
#   AB_TIME="python3 tools/bench_gemv.py --gemv-only" tools/dev/ab_variants.sh native/src/cuda/gemv_w2a8.cu ...
set -uo pipefail
cd "$(dirname "$0")/../.."
if [ $# -lt 2 ] || [ ! -f "$1" ]; then
    echo "usage: tools/dev/ab_variants.sh SOURCE ROUNDS VARIANT.cu ..." >&2
    exit 2
fi
source_file=$1 rounds=$2
shift 2
out=${OUT:-gpu-logs}/ab
time_cmd=${AB_TIME:-python3 tools/bench_attention.py --only decode --no-torch \
    --decode-cases 1x1024,1x4096,1x8192,1x32768,8x4096}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,serial --format=csv,noheader
make -j16 CUDA_ARCHS=90 > "$out/build.log" 2>&1 || { tail -30 "$out/build.log"; exit 1; }

names=(main) files=("$source_file")
for file in "$@"; do
    name=$(basename "${file%.*}")
    if [ ! -f "$file" ] || [[ " ${names[*]} " == *" $name "* ]]; then
        echo "variant $file: missing, or its name ($name) is taken" >&2
        exit 2
    fi
    names+=("$name") files+=("$file")
done
pids=()
for i in "${!names[@]}"; do
    dir=/tmp/ab/${names[$i]}
    rm -rf "$dir" && mkdir -p "$dir" && cp -a Makefile native build "$dir/"
    cp "${files[$i]}" "$dir/$source_file" && touch "$dir/$source_file"
    (cd "$dir" && make -j16 CUDA_ARCHS=90 > build.log 2>&1) &
    pids+=($!)
done
for i in "${!pids[@]}"; do
    wait "${pids[$i]}" || { echo "build of ${names[$i]} failed:"; tail -30 "/tmp/ab/${names[$i]}/build.log"; exit 1; }
done

if [ -n "${AB_TESTS:-}" ]; then
    for name in "${names[@]:1}"; do
        # eval, so that quotes inside AB_TESTS (-m "gpu or gpu_smoke") group as in a shell
        (export BITNET_LIB=/tmp/ab/$name/build/libbitnet.so BITNET_STRICT_MODE=1
         eval "python3 -m pytest -q -p no:cacheprovider $AB_TESTS") > "$out/tests-$name.log" 2>&1
        status=$?
        echo "tests on $name (exit $status): $(tail -1 "$out/tests-$name.log")"
    done
fi

order=("${names[@]}") results=()
for round in $(seq "$rounds"); do
    for name in "${order[@]}"; do
        json=$out/$name-$round.json
        if BITNET_LIB=/tmp/ab/$name/build/libbitnet.so $time_cmd --json "$json" > "$out/$name-$round.log" 2>&1; then
            results+=("$name=$json")
        else
            echo "timing $name (round $round) failed:"; tail -5 "$out/$name-$round.log"
        fi
    done
    order=("${order[@]:1}" "${order[0]}")
done
[ ${#results[@]} -eq 0 ] || python3 tools/report.py --ab "${results[@]}"
