"""bitnet-ffi (or python -m bitnet_ffi) COMMAND: info (devices and selection), demo (the main
job: a BitNet b1.58 2B4T decode through the library), generate (text from a real
checkpoint), tp (tensor-parallel decode over several GPUs)."""
import argparse
import json
import os
import sys
from pathlib import Path

from . import __version__, _ffi, library_version
from .device import select
from .errors import BitNetError


def _gib(n):
    return f"{n / 2**30:.1f} GiB" if n else "-"


def cpu_threads():
    """The threads the CPU ops run on: OMP_NUM_THREADS where set, else the CPUs this process may
    use (what libgomp takes by default)."""
    value = os.environ.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    return int(value) if value.isdigit() and int(value) > 0 else len(os.sched_getaffinity(0))


def info(args):
    selection = select(args.device)
    if args.json:
        print(json.dumps(selection.to_json(), indent=2))
        return 0
    print(selection.summary())
    rows = [("device", "name", "cc", "SMs", "memory (free/total)", "L2", "peak GB/s", "driver")]
    for d in selection.detection.devices:
        rows.append((d.label, d.name, d.compute_capability or "-", str(d.sm_count or "-"),
                     f"{_gib(d.free_memory_bytes)} / {_gib(d.total_memory_bytes)}",
                     f"{d.l2_cache_bytes // 2**20} MiB" if d.l2_cache_bytes else "-",
                     f"{d.peak_bandwidth_gbps:.0f}" if d.peak_bandwidth_gbps else "-",
                     d.driver_version or "-"))
    from .ternary import cpu_isa
    rows.append(("cpu", f"host CPU ({cpu_isa()}, {cpu_threads()} threads)", "-", "-", "-", "-",
                 "-", "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    if selection.detection.no_gpu_reason:
        print(f"no GPU: {selection.detection.no_gpu_reason}")
    return 0


def _version():
    try:
        return (f"bitnet-ffi {__version__}, libbitnet {'.'.join(map(str, library_version()))} "
                f"({_ffi.loaded_path})")
    except BitNetError as exc:
        return f"bitnet-ffi {__version__}, libbitnet not loaded: {exc}"


def main(argv=None):
    prog = "python -m bitnet_ffi" if Path(sys.argv[0]).name == "__main__.py" else "bitnet-ffi"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=_version())
    commands = parser.add_subparsers(dest="command", required=True)
    info_parser = commands.add_parser("info", help="show devices and which one is selected")
    info_parser.add_argument("--json", action="store_true", help="print one JSON object")
    info_parser.add_argument("--device", help="as BITNET_DEVICE: auto, cpu, cuda or cuda:N")
    info_parser.set_defaults(run=info)
    from . import demo
    demo_parser = commands.add_parser("demo", help="prefill and greedy decode of a BitNet b1.58 "
                                                   "2B4T-shaped model, with timings")
    demo.add_arguments(demo_parser)
    demo_parser.set_defaults(run=demo.main)
    from . import generate
    generate_parser = commands.add_parser("generate", help="generate text with a real checkpoint "
                                                           "(Hugging Face directory or GGUF)")
    generate.add_arguments(generate_parser)
    generate_parser.set_defaults(run=generate.main)
    from . import tp_demo
    tp_parser = commands.add_parser("tp", help="tensor-parallel decode over --tp GPUs, one "
                                               "process each")
    tp_demo.add_arguments(tp_parser)
    tp_parser.set_defaults(run=tp_demo.main)
    args = parser.parse_args(argv)
    try:
        status = args.run(args)
        sys.stdout.flush()  # a closed pipe shows here, not at exit
        return status
    except (BitNetError, FileNotFoundError) as exc:
        print(f"error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # The reader went away (info | head -1): stop quietly. Python's own flush at exit would
        # raise again, so stdout goes to /dev/null (the recipe of Python's signal docs).
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
