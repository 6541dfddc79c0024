"""Runs the test tiers this machine can run, and says which ran and why.

    python ci/tiers.py [--tier auto|1|2|3|4|soak] [extra pytest arguments]

Tiers: 1 cpu (anywhere), 2 gpu_smoke, 3 gpu (integration, GPU-vs-CPU parity), 4 perf (the
performance targets, on an H100), plus multi_gpu where two or more GPUs exist, and soak (the CPU
memory soak, anywhere). auto runs
tier 1 and soak, and tiers 2 and 3 (and multi_gpu) on a machine with a real CUDA GPU; tier 4 runs
only when asked for. GPUs are probed through libbitnet itself, so BITNET_GPU_FAKE never counts.
A GPU tier asked for by number on a machine without a real CUDA GPU fails at once, saying why:
nothing would be tested. A run without GPU tests spreads over every core (pytest-xdist)."""
import argparse
import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIERS = {"1": ("cpu", "runs anywhere"), "2": ("gpu_smoke", "quick GPU checks"),
         "3": ("gpu", "GPU integration and parity"), "4": ("perf", "performance targets on an H100"),
         "soak": ("soak", "CPU memory soak, runs anywhere")}
NEEDS_GPU = ("2", "3", "4")
CPU_MARKERS = {marker for tier, (marker, _) in TIERS.items() if tier not in NEEDS_GPU}


def probe():
    """(real CUDA GPU count, reason when 0)."""
    sys.path.insert(0, str(REPO))
    from bitnet_ffi import _ffi
    count, reason = _ffi.ffi.new("int32_t *"), _ffi.ffi.new("const char **")
    _ffi.call("device_count", count, reason)
    return count[0], _ffi.ffi.string(reason[0]).decode()


def refusal(tier, gpus, reason):
    """Why an explicitly requested tier cannot run on this machine, or None if it can."""
    if tier in NEEDS_GPU and not gpus:
        marker, what = TIERS[tier]
        return (f"tier {tier} ({marker}: {what}) needs a real CUDA GPU and this machine has none "
                f"({reason}); its tests would all skip. --tier auto runs what this machine can.")
    return None


def choose(tier, gpus, reason):
    """[(marker, why)] to run, and [(marker, why not)] skipped."""
    if tier != "auto":
        marker, what = TIERS[tier]
        return [(marker, f"asked for ({what}); {gpus} real GPU(s)")], []
    run, skipped = [("cpu", "tier 1 runs anywhere"), ("soak", TIERS["soak"][1])], []
    for number in ("2", "3"):
        marker, what = TIERS[number]
        if gpus:
            run.append((marker, f"tier {number}, {what}: {gpus} real GPU(s)"))
        else:
            skipped.append((marker, f"tier {number}, {what}: no real CUDA GPU ({reason})"))
    if gpus >= 2:
        run.append(("multi_gpu", f"{gpus} GPUs"))
    else:
        skipped.append(("multi_gpu", f"needs 2 GPUs, found {gpus}"))
    skipped.append(("perf", "tier 4 runs only with --tier 4"))
    return run, skipped


def workers(markers):
    """pytest-xdist's arguments: the CPU tiers spread over every core (tests one at a time leave
    most of a small CI machine idle); a run with GPU tests stays in one process, as the tests share
    the GPU. [] where xdist is not installed."""
    if set(markers) <= CPU_MARKERS and importlib.util.find_spec("xdist"):
        return ["-n", "auto"]
    return []


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tier", default="auto", choices=["auto", *TIERS])
    args, pytest_args = parser.parse_known_args()
    gpus, reason = probe()
    refused = refusal(args.tier, gpus, reason)
    if refused:
        print(f"[tiers] error: {refused}", file=sys.stderr)
        return 2
    run, skipped = choose(args.tier, gpus, reason)
    for marker, why in run:
        print(f"[tiers] run  {marker:10s} {why}")
    for marker, why in skipped:
        print(f"[tiers] skip {marker:10s} {why}")
    expression = " or ".join(marker for marker, _ in run)
    if any(marker == "multi_gpu" for marker, _ in skipped):  # also where a test is gpu and multi_gpu
        expression = f"({expression}) and not multi_gpu"
    command = [sys.executable, "-m", "pytest", "-m", expression, *workers(m for m, _ in run), *pytest_args]
    print("[tiers] " + " ".join(command), flush=True)
    code = subprocess.call(command, cwd=REPO)
    print(f"[tiers] ran: {', '.join(m for m, _ in run)}; pytest exit code {code}")
    return code


if __name__ == "__main__":
    sys.exit(main())
