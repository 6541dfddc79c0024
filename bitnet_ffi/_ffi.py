"""The one module that owns the FFI: reading bitnet.h, loading libbitnet.so, and turning a status
into an exception. Everything else calls ``lib()`` and ``check()``."""
import os
import re
import threading
from pathlib import Path

import cffi

from .errors import BY_STATUS, BitNetError, InvalidArgumentError, LibraryNotFoundError

PACKAGE_DIR = Path(__file__).resolve().parent
REPO_DIR = PACKAGE_DIR.parent
HEADER_PATHS = (PACKAGE_DIR / "bitnet.h", REPO_DIR / "native" / "include" / "bitnet.h")
LIBRARY_NAME = "libbitnet.so"

ffi = cffi.FFI()
_lib = None
_lock = threading.Lock()


def _header_declarations():
    """The plain C between the CDEF markers of bitnet.h, comments removed, for ffi.cdef."""
    for path in HEADER_PATHS:
        if path.is_file():
            text = path.read_text()
            match = re.search(r"/\* BITNET_CDEF_BEGIN \*/(.*)/\* BITNET_CDEF_END \*/", text, re.S)
            if not match:
                raise LibraryNotFoundError(f"{path} has no BITNET_CDEF_BEGIN/END region")
            return re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)
    raise LibraryNotFoundError("bitnet.h not found; looked in " + ", ".join(map(str, HEADER_PATHS)))


def library_candidates():
    """Where the library is looked for, in order: BITNET_LIB alone if set, else the package folder
    and the repository's build folder."""
    override = os.environ.get("BITNET_LIB")
    if override:
        return [Path(override)]
    return [PACKAGE_DIR / LIBRARY_NAME, REPO_DIR / "build" / LIBRARY_NAME]


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def _load():
    ffi.cdef(_header_declarations())
    tried = []
    for path in library_candidates():
        if not path.is_file():
            tried.append(f"{path} (not found)")
            continue
        try:
            return ffi.dlopen(str(path))
        except OSError as exc:
            tried.append(f"{path} ({exc})")
    raise LibraryNotFoundError(
        "libbitnet.so could not be loaded. Tried: " + "; ".join(tried) +
        ". Run `make` in the repository root to build it, or set BITNET_LIB to its path.")


def last_error():
    message = ffi.new("const char **")
    lib().bitnet_get_last_error(message)
    return ffi.string(message[0]).decode(errors="replace")


def check(status):
    """Raises the exception that matches a non-OK status, with the library's message."""
    if status != 0:
        cls = BY_STATUS.get(int(status), BitNetError)
        raise cls(last_error(), status=int(status))


def call(name, *args):
    """Calls bitnet_<name>(*args) and checks its status. A number that does not fit its C type (an
    int past int32_t, say) is an InvalidArgumentError too, and nothing runs. (The callers convert
    every argument first, so a TypeError here would be a bug of ours, and is left as it is.)"""
    function = getattr(lib(), "bitnet_" + name)
    try:
        status = function(*args)
    except OverflowError as exc:
        raise InvalidArgumentError(f"bitnet_{name}: {exc}") from None
    check(status)
