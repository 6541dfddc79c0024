/* Streams, events and CUDA graphs for callers without a framework of their own. */
#include "common.cuh"

bitnet_status bn_cuda_stream_create(int32_t device, void **stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaStream_t s;
    BN_CUDA_TRY(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    *stream = s;
    return BITNET_OK;
}

bitnet_status bn_cuda_stream_destroy(int32_t device, void *stream) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaStreamDestroy(bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_event_create(int32_t device, void **event) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    cudaEvent_t e;
    BN_CUDA_TRY(cudaEventCreate(&e));
    *event = e;
    return BITNET_OK;
}

bitnet_status bn_cuda_event_destroy(int32_t device, void *event) {
    BnDeviceGuard guard;
    BN_CUDA_ENTER(guard, device);
    BN_CUDA_TRY(cudaEventDestroy(static_cast<cudaEvent_t>(event)));
    return BITNET_OK;
}

bitnet_status bn_cuda_event_record(void *event, void *stream) {
    BN_CUDA_TRY(cudaEventRecord(static_cast<cudaEvent_t>(event), bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_event_elapsed_ms(void *start, void *end, float *ms) {
    BN_CUDA_TRY(cudaEventSynchronize(static_cast<cudaEvent_t>(end)));
    BN_CUDA_TRY(cudaEventElapsedTime(ms, static_cast<cudaEvent_t>(start),
                                     static_cast<cudaEvent_t>(end)));
    return BITNET_OK;
}

bitnet_status bn_cuda_graph_capture_begin(void *stream) {
    BN_CUDA_TRY(cudaStreamBeginCapture(bn_stream(stream), cudaStreamCaptureModeThreadLocal));
    return BITNET_OK;
}

bitnet_status bn_cuda_graph_capture_end(void *stream, void **graph) {
    cudaGraph_t captured;
    BN_CUDA_TRY(cudaStreamEndCapture(bn_stream(stream), &captured));
    cudaGraphExec_t exec;
    cudaError_t err = cudaGraphInstantiate(&exec, captured, 0);
    cudaGraphDestroy(captured);
    BN_CUDA_TRY(err);
    *graph = exec;
    return BITNET_OK;
}

bitnet_status bn_cuda_graph_launch(void *graph, void *stream) {
    BN_CUDA_TRY(cudaGraphLaunch(static_cast<cudaGraphExec_t>(graph), bn_stream(stream)));
    return BITNET_OK;
}

bitnet_status bn_cuda_graph_destroy(void *graph) {
    BN_CUDA_TRY(cudaGraphExecDestroy(static_cast<cudaGraphExec_t>(graph)));
    return BITNET_OK;
}
