/* Public entry points for streams, events and CUDA graphs: thin checks over cuda/graph.cu. */
#include "internal.h"

bitnet_status bitnet_stream_create(int32_t device, void **stream) {
    BN_CHECK(stream, "stream_create: stream is NULL");
    BN_CHECK(device >= 0, "stream_create: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_stream_create(device, stream));
}

bitnet_status bitnet_stream_destroy(int32_t device, void *stream) {
    BN_CHECK(stream, "stream_destroy: stream is NULL (the default stream cannot be destroyed)");
    BN_CHECK(device >= 0, "stream_destroy: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_stream_destroy(device, stream));
}

bitnet_status bitnet_event_create(int32_t device, void **event) {
    BN_CHECK(event, "event_create: event is NULL");
    BN_CHECK(device >= 0, "event_create: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_event_create(device, event));
}

bitnet_status bitnet_event_destroy(int32_t device, void *event) {
    BN_CHECK(event, "event_destroy: event is NULL");
    BN_CHECK(device >= 0, "event_destroy: device %d is not a CUDA device index", device);
    BN_TRY(bn_check_device(device));
    return BN_CUDA(bn_cuda_event_destroy(device, event));
}

bitnet_status bitnet_event_record(void *event, void *stream) {
    BN_CHECK(event, "event_record: event is NULL");
    return BN_CUDA(bn_cuda_event_record(event, stream));
}

bitnet_status bitnet_event_elapsed_ms(void *start, void *end, float *ms) {
    BN_CHECK(start && end && ms, "event_elapsed_ms: NULL %s", !start ? "start" : !end ? "end" : "ms");
    return BN_CUDA(bn_cuda_event_elapsed_ms(start, end, ms));
}

bitnet_status bitnet_graph_capture_begin(void *stream) {
    BN_CHECK(stream, "graph_capture_begin: the legacy default stream cannot be captured; "
                     "use a stream from bitnet_stream_create (or PyTorch / CuPy)");
    return BN_CUDA(bn_cuda_graph_capture_begin(stream));
}

bitnet_status bitnet_graph_capture_end(void *stream, void **graph) {
    BN_CHECK(stream && graph, "graph_capture_end: %s is NULL", !stream ? "stream" : "graph");
    return BN_CUDA(bn_cuda_graph_capture_end(stream, graph));
}

bitnet_status bitnet_graph_launch(void *graph, void *stream) {
    BN_CHECK(graph, "graph_launch: graph is NULL");
    return BN_CUDA(bn_cuda_graph_launch(graph, stream));
}

bitnet_status bitnet_graph_destroy(void *graph) {
    BN_CHECK(graph, "graph_destroy: graph is NULL");
    return BN_CUDA(bn_cuda_graph_destroy(graph));
}
