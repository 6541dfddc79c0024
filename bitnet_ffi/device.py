"""Device detection and selection: the one place that reads BITNET_GPU_FAKE, BITNET_STRICT_MODE,
BITNET_STRICT_NO_FAKE_GPU and BITNET_DEVICE.

Rules:
- Real devices come from libbitnet's device_info, enriched with pynvml (package nvidia-ml-py) where
  it is installed: driver version, used memory, utilization.
- BITNET_GPU_FAKE mocks detection: a case-insensitive list split on commas, semicolons or spaces of
  cuda, rocm, metal (gpu means cuda); "", none and 0 mean no fake. Fakes are added after the real
  devices and marked fake everywhere. A fake never runs a kernel.
- BITNET_STRICT_MODE=1 ignores the fake, and says so (a warning, and a note in info);
  BITNET_STRICT_NO_FAKE_GPU=1 with a fake set is an error.
- BITNET_DEVICE = auto (default) | cpu | cuda | cuda:N (gpu and gpu:N mean the same, as in
  BITNET_GPU_FAKE). auto picks the first real GPU, else the CPU (saying so when a fake GPU was
  passed over). cuda where none exists is an error.
"""
import numbers
import os
import re
import warnings
from dataclasses import asdict, dataclass, field

from . import _ffi
from .errors import ArgumentTypeError, ConfigurationError, NoDeviceError

FAKE_BACKENDS = ("cuda", "rocm", "metal")
FAKE_ALIASES = {"gpu": "cuda"}
NO_FAKE = ("", "none", "0")


@dataclass
class Device:
    """One device as detection sees it; `backend` is cuda, rocm or metal."""
    backend: str
    index: int
    name: str
    fake: bool = False
    pci_bus_id: str = ""
    compute_capability: str = ""
    total_memory_bytes: int = 0
    free_memory_bytes: int = 0
    used_memory_bytes: int | None = None
    utilization_percent: int | None = None
    sm_count: int = 0
    max_threads_per_block: int = 0
    shared_memory_per_block_bytes: int = 0
    shared_memory_per_block_optin_bytes: int = 0
    l2_cache_bytes: int = 0
    memory_bus_width_bits: int = 0
    memory_clock_khz: int = 0
    peak_bandwidth_gbps: float = 0.0
    supports_fp16: bool = False
    supports_bf16: bool = False
    supports_int8_dot: bool = False
    driver_version: str = ""
    runtime_version: str = ""

    @property
    def label(self):
        return f"{self.backend}:{self.index}" + (" (fake)" if self.fake else "")


@dataclass
class Detection:
    devices: list
    fake: bool
    strict: bool
    no_gpu_reason: str = ""
    backends: list = field(default_factory=list)
    ignored_fake: str = ""  # the BITNET_GPU_FAKE value that strict mode ignored

    def labels(self):
        """The backends, one seen only through BITNET_GPU_FAKE marked: ["cuda(fake)", "cpu"]."""
        def label(backend):
            only_fake = all(d.fake for d in self.devices if d.backend == backend)
            return backend + ("(fake)" if backend != "cpu" and only_fake else "")
        return [label(backend) for backend in self.backends]

    def summary_detected(self):
        """detected=[cuda,cpu], a backend seen only through BITNET_GPU_FAKE shown as cuda(fake)."""
        return "detected=[" + ",".join(self.labels()) + "]"

    def strict_note(self):
        return (f"BITNET_STRICT_MODE=1 ignores BITNET_GPU_FAKE={self.ignored_fake!r}"
                if self.ignored_fake else "")


@dataclass
class Selection:
    requested: str
    selected: str          # "cpu" or "cuda:N"
    device: int            # -1 for the CPU, else the CUDA device index
    fake: bool             # the selected device is a fake (it cannot run kernels)
    detection: Detection
    note: str = ""

    def notes(self):
        return "; ".join(filter(None, (self.note, self.detection.strict_note())))

    def summary(self):
        line = (f"requested={self.requested} {self.detection.summary_detected()} "
                f"selected={self.selected}" + (" (fake)" if self.fake else ""))
        return line + (f" note: {self.notes()}" if self.notes() else "")

    def to_json(self):
        return {"requested": self.requested, "selected": self.selected,
                "fake": self.detection.fake, "selected_is_fake": self.fake,
                "strict": self.detection.strict, "detected": self.detection.labels(),
                "note": self.notes(), "no_gpu_reason": self.detection.no_gpu_reason,
                "devices": [asdict(d) | {"label": d.label} for d in self.detection.devices]}


def _flag(name):
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_fake(value):
    """The backends named by a BITNET_GPU_FAKE value, in order, without repeats."""
    value = (value or "").strip().lower()
    if value in NO_FAKE:
        return []
    backends = []
    for token in filter(None, re.split(r"[,;\s]+", value)):
        backend = FAKE_ALIASES.get(token, token)
        if backend in NO_FAKE:
            continue
        if backend not in FAKE_BACKENDS:
            raise ConfigurationError(f"BITNET_GPU_FAKE: unknown backend {token!r} (expected "
                                     f"{', '.join(FAKE_BACKENDS)}, gpu, none or 0)")
        if backend not in backends:
            backends.append(backend)
    return backends


def _real_devices():
    lib, ffi = _ffi.lib(), _ffi.ffi
    count, reason = ffi.new("int32_t *"), ffi.new("const char **")
    _ffi.check(lib.bitnet_device_count(count, reason))
    devices = []
    for index in range(count[0]):
        info = ffi.new("bitnet_device_info *")
        _ffi.check(lib.bitnet_device_get_info(index, info))
        devices.append(Device(
            backend="cuda", index=index, name=ffi.string(info.name).decode(),
            pci_bus_id=ffi.string(info.pci_bus_id).decode(),
            compute_capability=f"{info.compute_capability_major}.{info.compute_capability_minor}",
            total_memory_bytes=info.total_memory_bytes, free_memory_bytes=info.free_memory_bytes,
            sm_count=info.sm_count, max_threads_per_block=info.max_threads_per_block,
            shared_memory_per_block_bytes=info.shared_memory_per_block_bytes,
            shared_memory_per_block_optin_bytes=info.shared_memory_per_block_optin_bytes,
            l2_cache_bytes=info.l2_cache_bytes, memory_bus_width_bits=info.memory_bus_width_bits,
            memory_clock_khz=info.memory_clock_khz, peak_bandwidth_gbps=info.peak_bandwidth_gbps,
            supports_fp16=bool(info.supports_fp16), supports_bf16=bool(info.supports_bf16),
            supports_int8_dot=bool(info.supports_int8_dot),
            driver_version=_cuda_version(info.driver_version),
            runtime_version=_cuda_version(info.runtime_version)))
    _enrich_with_nvml(devices)
    return devices, ffi.string(reason[0]).decode()


def _cuda_version(code):
    return f"{code // 1000}.{code % 1000 // 10}"


def _enrich_with_nvml(devices):
    """Adds the driver's version string, used memory and utilization from NVML where available."""
    if not devices:
        return
    try:
        import pynvml
        pynvml.nvmlInit()
    except Exception:  # no nvidia-ml-py, or no driver: the library's figures stand alone
        return
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        for device in devices:
            handle = pynvml.nvmlDeviceGetHandleByPciBusId(device.pci_bus_id)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            device.driver_version = driver if isinstance(driver, str) else driver.decode()
            device.used_memory_bytes = int(memory.used)
            device.utilization_percent = int(pynvml.nvmlDeviceGetUtilizationRates(handle).gpu)
    except pynvml.NVMLError:
        pass
    finally:
        pynvml.nvmlShutdown()


def detect():
    """Devices seen under the current environment: the real ones, then fakes where allowed."""
    strict = _flag("BITNET_STRICT_MODE")
    fake_backends = parse_fake(os.environ.get("BITNET_GPU_FAKE"))
    if fake_backends and _flag("BITNET_STRICT_NO_FAKE_GPU"):
        raise ConfigurationError(
            f"BITNET_GPU_FAKE={os.environ['BITNET_GPU_FAKE']!r} is set, but "
            f"BITNET_STRICT_NO_FAKE_GPU=1 forbids fake GPUs")
    ignored = ""
    if strict and fake_backends:
        ignored, fake_backends = os.environ["BITNET_GPU_FAKE"], []
        warnings.warn(f"BITNET_STRICT_MODE=1 ignores BITNET_GPU_FAKE={ignored!r}", stacklevel=2)
    devices, reason = _real_devices()
    for backend in fake_backends:
        index = sum(d.backend == backend for d in devices)
        devices.append(Device(backend=backend, index=index, name=f"fake {backend} device",
                              fake=True))
    backends = []
    for d in devices:
        if d.backend not in backends:
            backends.append(d.backend)
    return Detection(devices=devices, fake=bool(fake_backends), strict=strict,
                     no_gpu_reason=reason, backends=backends + ["cpu"], ignored_fake=ignored)


def select(requested=None):
    """Applies BITNET_DEVICE (or `requested`) to the detection."""
    source = "device" if requested else "BITNET_DEVICE"
    if requested is not None and not isinstance(requested, str):
        raise ArgumentTypeError(f"device: expected a name (auto, cpu, cuda, cuda:N) or an index, "
                                f"got {requested!r}")
    requested = (requested or os.environ.get("BITNET_DEVICE") or "auto").strip().lower()
    detection = detect()
    cuda = [d for d in detection.devices if d.backend == "cuda"]
    real = [d for d in cuda if not d.fake]
    if requested == "auto":
        if real:
            return Selection(requested, f"cuda:{real[0].index}", real[0].index, False, detection)
        note = ("a fake GPU cannot run kernels: fell back to the CPU"
                if any(d.fake for d in detection.devices) else "")
        return Selection(requested, "cpu", -1, False, detection, note)
    if requested == "cpu":
        return Selection(requested, "cpu", -1, False, detection)
    match = re.fullmatch(r"(?:cuda|gpu)(?::(\d+))?", requested)
    if not match:
        raise ConfigurationError(f"{source}={requested!r}: expected auto, cpu, cuda or cuda:N "
                                 f"(gpu, gpu:N)")
    index = int(match.group(1) or 0)
    for d in cuda:
        if d.index == index:
            return Selection(requested, f"cuda:{index}", index, d.fake, detection,
                             "a fake GPU: ops sent to it raise NoDeviceError" if d.fake else "")
    found = ", ".join(d.label for d in cuda) or "none"
    why = f" ({detection.no_gpu_reason})" if detection.no_gpu_reason else ""
    raise NoDeviceError(f"{source}={requested}: no such CUDA device (CUDA devices: {found}){why}")


def resolve(device=None):
    """The device index an op or a transfer should use for `device` ("cpu", "cuda", "cuda:N",
    "auto", an int, or None for BITNET_DEVICE): -1 for the CPU. A fake GPU raises NoDeviceError,
    except under auto, which has already fallen back to the CPU."""
    if isinstance(device, numbers.Integral):
        device = "cpu" if device < 0 else f"cuda:{int(device)}"
    selection = select(device)
    if selection.fake:
        raise NoDeviceError(f"{selection.selected} is a fake GPU (BITNET_GPU_FAKE) and cannot run "
                            f"kernels; unset BITNET_GPU_FAKE or use a real device")
    return selection.device
