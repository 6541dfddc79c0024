#!/usr/bin/env bash
# Runs a representative subset of the GPU tests (tier 3) under compute-sanitizer: memcheck (out of
# bounds and misaligned device accesses, bad API arguments) and racecheck (shared-memory hazards).
#
#   tools/gpu_sanitize.sh                 build build-sanitize (sm_90) and run both tools
#   BITNET_LIB=path tools/gpu_sanitize.sh test an already built library
#   SANITIZE_TOOLS="memcheck" SANITIZE_TIMEOUT=300 tools/gpu_sanitize.sh
#
# The subset runs every op's kernels at small shapes (the whole of tier 3 takes far longer under the
# sanitizer): each op's valid call from the bad-input matrix, the smoke tests, the paths that guard
# against out-of-range device-resident lengths, positions and ids, unaligned rows, RMSNorm with more
# rows than are resident at once (its L2 prefetches of rows ahead) and with eps = 0, decode
# attention's cluster path at 4, 5 and 6 stages and its split path with the merge kernel, CUDA
# graphs and DeviceArray, and (memcheck only) eight threads on their own streams. Each tool gets
# SANITIZE_TIMEOUT seconds (default 120); errors are printed as they are found, so a run cut short
# by the timeout still reports what it saw. Exit status: 0 when every tool ran clean.
#   tools/gpu_sanitize.sh --list          print the test ids and exit
set -u
cd "$(dirname "$0")/.."

ATTENTION=tests/test_attention.py
RMSNORM=tests/test_rmsnorm.py
SUBSET=(
    tests/test_bad_input_matrix.py::test_the_valid_call_succeeds_on_the_gpu
    $ATTENTION::{test_gpu_smoke_decode,test_gpu_ragged_matches_cpu_and_reference}
    $ATTENTION::{test_gpu_device_seq_lens_out_of_range_give_nan_for_that_sequence_only,test_gpu_device_array_and_cuda_graph_replay}
    "$ATTENTION::test_gpu_decode_matches_reference_and_sdpa["{case3-bfloat16,case12-bfloat16,case13-float16,case14-bfloat16}"]"
    tests/test_layer_glue.py::{test_gpu_smoke_relu2_gate,test_gpu_rope_device_positions_out_of_range_are_skipped}
    $RMSNORM::{test_gpu_smoke,test_gpu_unaligned_rows_take_the_scalar_path,test_zero_row_with_eps_0_is_nan_and_leaves_the_other_rows}
    "$RMSNORM::test_gpu_matches_reference_and_cpu["{4096-2560-quant-bfloat16,4096-2560-add_quant_y-bfloat16,20000-256-quant-float16}"]"
    "$RMSNORM::test_gpu_relu2_rmsnorm_matches_reference_two_ops_and_cpu[4096-2560-quant-bfloat16]"
    tests/test_quantize.py::test_pack_unpack_gpu_device_array
    tests/test_bad_input_matrix.py::test_pack_gpu_rejects_non_ternary_untouched
    tests/test_gemv_w2a8.py::test_gemv_gpu_device_array_and_quantized_inputs
    tests/test_head.py::{test_argmax_gpu_matches_numpy,test_embedding_gpu_matches_cpu,test_gemv_bf16_gpu_matches_cpu_and_reference,test_graph_capture_replays_the_ops}
    tests/test_memory_abi.py::test_round_trip_host_device_device_host
)
MEMCHECK_ONLY=(tests/test_concurrency.py::test_threads_calling_every_op_match_serial_runs)
if [ "${1:-}" = --list ]; then
    printf '%s\n' "${SUBSET[@]}" "${MEMCHECK_ONLY[@]}"
    exit 0
fi

if [ -z "${BITNET_LIB:-}" ]; then
    make -j"$(nproc)" BUILD_DIR=build-sanitize CUDA_ARCHS="${CUDA_ARCHS:-90}" >/dev/null || exit 1
    export BITNET_LIB="$PWD/build-sanitize/libbitnet.so"
fi
# One cudaMalloc per tensor: with PyTorch's caching allocator an overrun into the rest of a cached
# block would be invisible to memcheck.
export PYTORCH_NO_CUDA_MEMORY_CACHING=1

status=0
for tool in ${SANITIZE_TOOLS:-memcheck racecheck}; do
    tests=("${SUBSET[@]}")
    [ "$tool" = memcheck ] && tests+=("${MEMCHECK_ONLY[@]}")
    echo "[gpu_sanitize] $tool: ${#tests[@]} test functions, timeout ${SANITIZE_TIMEOUT:-120} s"
    start=$SECONDS
    timeout "${SANITIZE_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --error-exitcode 99 \
        --print-limit 50 python3 -m pytest -q -p no:cacheprovider -m "gpu or gpu_smoke" "${tests[@]}"
    code=$?
    case $code in
        0) verdict="clean" ;;
        99) verdict="ERRORS reported" ;;
        124) verdict="TIMED OUT (partial run; errors above, if any)" ;;
        *) verdict="pytest or sanitizer failure" ;;
    esac
    echo "[gpu_sanitize] $tool: exit $code, $verdict, $((SECONDS - start)) s"
    [ "$code" = 0 ] || status=1
done
exit $status
