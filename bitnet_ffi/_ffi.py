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
loaded_path = None  # the libbitnet.so that lib() loaded
_declared = False
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
    """Where the library is looked for, in order: BITNET_LIB alone if set (a file, or a folder
    holding libbitnet.so), else the package folder and the repository's build folder."""
    override = os.environ.get("BITNET_LIB")
    if override:
        path = Path(override)
        return [path / LIBRARY_NAME if path.is_dir() else path]
    return [PACKAGE_DIR / LIBRARY_NAME, REPO_DIR / "build" / LIBRARY_NAME]


def in_checkout():
    """True when the package runs from a source checkout (or an editable install of one), where
    `make` builds the library; False for an installed wheel."""
    return (REPO_DIR / "Makefile").is_file() and (REPO_DIR / "native").is_dir()


def lib():
    """The loaded library (loaded on first use; a failed load is tried again on the next call)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def _declare():
    """Gives cffi the header's declarations, once per process (a second cdef would redeclare)."""
    global _declared
    if not _declared:
        ffi.cdef(_header_declarations())
        _declared = True


def _load():
    global loaded_path
    _declare()
    tried = []
    for path in library_candidates():
        if not path.is_file():
            tried.append(f"{path} (not found)")
            continue
        try:
            # Loaded for the life of the process: unloading it at exit would unload libgomp under
            # its still running worker threads (a crash at exit). The library is also linked with
            # -z nodelete, which keeps it loaded for any other loader.
            library = ffi.dlopen(str(path), ffi.RTLD_NOW | ffi.RTLD_NODELETE)
            loaded_path = path
            return library
        except OSError as exc:
            tried.append(f"{path} ({exc})")
    if in_checkout():
        hint = f"Run `make` in {REPO_DIR} to build it"
    else:
        hint = (f"This installed bitnet-ffi ({PACKAGE_DIR}) lacks it: reinstall the package "
                "from its source (`pip install --force-reinstall` the sdist or a checkout), with "
                "make and a C compiler present, which builds it")
    raise LibraryNotFoundError("libbitnet.so could not be loaded. Tried: " + "; ".join(tried) +
                               f". {hint}, or set BITNET_LIB to its path (or its folder).")


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
