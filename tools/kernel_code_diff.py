"""Whether a change to a CUDA source changes the machine code of its kernels (no GPU needed).

    python tools/kernel_code_diff.py native/src/cuda/gemv_w2a8.cu [--ref HEAD] [--with FILE] [--arch 90]

Compiles the file as it is at git revision REF (with REF's headers: its native/ tree) and as it is
in the working tree (or FILE, a variant kept elsewhere, with the tree's headers) to cubins with
nvcc, and compares the bytes of each kernel's code (its ELF .text section). A kernel printed "same" runs exactly as before, so a refactor that leaves every kernel the
same needs no GPU A/B; one that does not is timed (docs/developing.md). Exits 1 if any differs.
"""
import argparse
import re
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def text_sections(cubin):
    """{kernel name: code bytes} of a 64-bit little-endian ELF cubin; the anonymous namespace, whose
    mangled name holds the file's name and a hash, is written (anonymous)."""
    data = cubin.read_bytes()
    (section_table,) = struct.unpack_from("<Q", data, 0x28)
    entry_size, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQIIQQ", data, section_table + i * entry_size) for i in range(count)]
    names_offset, names_size = headers[names_index][4], headers[names_index][5]
    names = data[names_offset:names_offset + names_size]
    sections = {}
    for name_at, _, _, _, offset, size, *_ in headers:
        name = names[name_at:names.index(b"\0", name_at)].decode()
        if name.startswith(".text."):
            kernel = re.sub(r"\d+_GLOBAL__N__[0-9a-f]+_\d+_\w+?_cu_[0-9a-f]{8}", "(anonymous)", name[len(".text."):])
            sections[kernel] = data[offset:offset + size]
    return sections


def compile_cubin(source, root, cubin, arch):
    """The Makefile's device-code flags (its NVCCFLAGS and CPPFLAGS), for one architecture, with the
    headers of the checkout at `root`."""
    subprocess.run(["nvcc", "-O3", "-std=c++17", f"-arch=sm_{arch}", "--expt-relaxed-constexpr",
                    "-DBITNET_HAVE_CUDA", f"-I{root / 'native/include'}", f"-I{root / 'native/src'}",
                    f"-I{root / 'native/src/cuda'}", "-cubin", str(source), "-o", str(cubin)], check=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", help="a CUDA source of this repository, e.g. native/src/cuda/rmsnorm.cu")
    parser.add_argument("--ref", default="HEAD", help="the git revision to compare with (default HEAD)")
    parser.add_argument("--with", dest="other", help="compare REF with this file instead of the tree's")
    parser.add_argument("--arch", help="the SM architecture to compile for (default 90; 90a for the "
                        "Hopper-only sources, *_sm90.cu, which the Makefile builds for sm_90a alone: "
                        "for sm_90 their wgmma code compiles to traps)")
    args = parser.parse_args()
    relative = Path(args.source).resolve().relative_to(REPO).as_posix()
    args.arch = args.arch or ("90a" if relative.endswith("_sm90.cu") else "90")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = subprocess.run(["git", "archive", args.ref, "native"], cwd=REPO, capture_output=True,
                                 check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(tmp)], input=archive, check=True)
        compile_cubin(tmp / relative, tmp, tmp / "before.cubin", args.arch)
        compile_cubin(Path(args.other or REPO / relative), REPO, tmp / "after.cubin", args.arch)
        old, new = text_sections(tmp / "before.cubin"), text_sections(tmp / "after.cubin")
    changed = False
    for kernel in sorted(set(old) | set(new)):
        a, b = old.get(kernel), new.get(kernel)
        if a is None or b is None:
            verdict = f"only in {'the change' if a is None else args.ref}"
        elif a == b:
            verdict = "same"
        else:
            differing = sum(a[i:i + 16] != b[i:i + 16] for i in range(0, min(len(a), len(b)), 16))
            verdict = f"differs: {differing} of {len(a) // 16} -> {len(b) // 16} instructions"
        changed |= verdict != "same"
        print(f"{verdict:48s} {kernel}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
