"""CUDA streams, events and graphs through libbitnet, for callers without PyTorch or CuPy (the demo
captures its decode step with these)."""
import weakref

from . import _ffi
from ._arrays import integer
from .errors import ArgumentTypeError


def _handle(kind, device):
    out = _ffi.ffi.new("void **")
    _ffi.call(f"{kind}_create", device, out)
    return out[0]


def _stream(stream):
    if not isinstance(stream, Stream):
        raise ArgumentTypeError(f"stream: expected a bitnet_ffi.Stream, got {type(stream).__name__}")
    return stream


class Stream:
    """A non-blocking CUDA stream on `device`. ``int(stream)`` is its cudaStream_t, accepted by every
    op's ``stream=``."""

    def __init__(self, device=0):
        self.device = integer(device, "device")
        self.handle = _handle("stream", self.device)
        weakref.finalize(self, _ffi.lib().bitnet_stream_destroy, self.device, self.handle)

    def __int__(self):
        return int(_ffi.ffi.cast("uintptr_t", self.handle))

    def synchronize(self):
        _ffi.call("stream_synchronize", self.handle)


class Event:
    def __init__(self, device=0):
        self.device = integer(device, "device")
        self.handle = _handle("event", self.device)
        weakref.finalize(self, _ffi.lib().bitnet_event_destroy, self.device, self.handle)

    def record(self, stream):
        _ffi.call("event_record", self.handle, _stream(stream).handle)

    def elapsed_ms(self, end):
        """Milliseconds from this event to `end` (waits for `end`)."""
        if not isinstance(end, Event):
            raise ArgumentTypeError(f"end: expected a bitnet_ffi.Event, got {type(end).__name__}")
        ms = _ffi.ffi.new("float *")
        _ffi.call("event_elapsed_ms", self.handle, end.handle, ms)
        return ms[0]


class Graph:
    """Work captured from a stream once and replayed with ``launch()``::

        with Graph.capture(stream) as graph:
            step(stream)           # ops called with stream=stream
        graph.launch()
    """

    def __init__(self, stream):
        self.stream = _stream(stream)
        self.handle = None

    @classmethod
    def capture(cls, stream):
        return cls(stream)

    def __enter__(self):
        _ffi.call("graph_capture_begin", self.stream.handle)
        return self

    def __exit__(self, exc_type, exc, tb):
        out = _ffi.ffi.new("void **")
        status = _ffi.lib().bitnet_graph_capture_end(self.stream.handle, out)
        if exc_type is None:
            _ffi.check(status)
            self.handle = out[0]
            self._destroy = weakref.finalize(self, _ffi.lib().bitnet_graph_destroy, self.handle)
        return False

    def close(self):
        """Destroys the graph now (else when it is garbage): a graph holding NCCL collectives must
        go before its communicator, whose destruction waits for every such graph."""
        if self.handle is not None:
            self._destroy()
            self.handle = None

    def launch(self):
        _ffi.call("graph_launch", self.handle, self.stream.handle)

    def time_ms(self, replays=10, reset=None):
        """Device milliseconds of one replay: after a warm-up, three runs of `replays` replays
        back to back, each timed with events; the median run, per replay. ``reset()``, if given,
        runs before the warm-up and before each run, untimed: for work whose replays move state
        along (a decode step's positions), so that every run starts from the same state."""
        start, end = Event(self.stream.device), Event(self.stream.device)
        if reset:
            reset()
        self.launch()
        times = []
        for _ in range(3):
            if reset:
                reset()
            start.record(self.stream)
            for _ in range(replays):
                self.launch()
            end.record(self.stream)
            times.append(start.elapsed_ms(end) / replays)
        return sorted(times)[1]
