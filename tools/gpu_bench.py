"""What every GPU benchmark here shares: timing calls as CUDA-graph replays, and the read bandwidth
to compare with, measured in the same run. (torch is imported where used, so that a tool's CPU mode
runs without it.)

Method: the calls are warmed up outside the graph (lazy loading, allocations), captured once, and
the graph is replayed REPLAYS times; the figure is the median time per call. Callers rotate their
inputs through more than 4x the L2 (the `slots`), so no call finds its data in L2."""
import statistics

REPLAYS = 7
WARM_UP_SLOTS = 16


def graph_time_us(call, slots=1, calls=None):
    """Median µs per call of a CUDA graph that makes `calls` calls (default: `slots`), call i
    being call(i % slots)."""
    import torch
    calls = calls or slots
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(slots, WARM_UP_SLOTS)):
            call(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            call(i % slots)
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    del graph
    return statistics.median(times)


def read_bandwidth_gbps():
    """torch.sum over a 2 GiB float32 buffer, graph-timed: the read bandwidth to compare with."""
    import torch
    buffer = torch.ones(1 << 29, dtype=torch.float32, device="cuda")
    us = graph_time_us(lambda _: buffer.sum(), 1, 5)
    del buffer
    return (1 << 31) / us / 1e3
