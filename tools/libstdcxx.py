"""Make _C use the process's libstdc++, also where the compiler would link its own.

Some compilers' drivers link libstdc++ statically into every shared object
(the lent GPU machine's /opt/gcc does: its _C had no libstdc++.so.6 among its
needed libraries). torch has already loaded the shared libstdc++ when _C is
imported, and the dynamic linker then binds part of _C's references to that
copy and part to the copy inside _C. The two copies number locale facets
differently, so an ostream inside _C picks the wrong facet when it formats a
number: every `dllm::<op>:` error that prints a shape or a count segfaulted on
the GPU machine (`make gpu-check`, 2026-12-04), and came out cut at the first
number on a CPU with a stand-in for that compiler.

setup.py asks `libstdcxx_to_link()`: it links a one-line probe with the
compiler torch will use and, when the probe carries libstdc++ inside it, names
the shared libstdc++ this process has loaded (torch's), which setup.py then
puts on _C's link line. The linker resolves libstdc++'s symbols from that
library first, so nothing is taken from the static archive the driver adds at
the end. Everywhere else the function returns None and the build is unchanged.
The probe asks the compiler torch compiles with; should the link step use
another driver, setup.py also reads the built _C (`lacks_shared_libstdcxx`)
and relinks it with that library once. `python tools/libstdcxx.py --check`
exits 1 when the built _C lacks it (`make gpu-check` runs it after the build).
"""
from __future__ import annotations

import os
import struct
import subprocess
import tempfile

# One function that formats a number through an ostream: a shared-linked probe
# imports std::ostream::_M_insert<long> from libstdc++.so.6, a static one
# carries it.
_PROBE = "#include <sstream>\n#include <string>\n" \
         "std::string dllm_probe(long x) { std::ostringstream s; s << x; return s.str(); }\n"


def compiler() -> str:
    """The C++ compiler torch's extension build compiles and links with."""
    return os.environ.get("CXX", "c++")


def needed_libraries(path: str) -> list[str] | None:
    """The DT_NEEDED entries of a 64-bit little-endian ELF shared object (what
    ``readelf -d`` lists as NEEDED), read from the file itself so no binutils
    are needed; None when the file is not such an object or cannot be read."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:   # ELFCLASS64, ELFDATA2LSB
        return None
    try:
        phoff, = struct.unpack_from("<Q", data, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
        loads, dynamic = [], None
        for i in range(phnum):
            p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(
                "<IIQQQQQQ", data, phoff + i * phentsize)
            if p_type == 1:                                   # PT_LOAD
                loads.append((p_vaddr, p_offset, p_filesz))
            elif p_type == 2:                                 # PT_DYNAMIC
                dynamic = (p_offset, p_filesz)
        if dynamic is None:
            return []
        needed, strtab = [], None
        for at in range(dynamic[0], dynamic[0] + dynamic[1], 16):
            tag, val = struct.unpack_from("<qQ", data, at)
            if tag == 0:                                      # DT_NULL
                break
            if tag == 1:                                      # DT_NEEDED: offset into DT_STRTAB
                needed.append(val)
            elif tag == 5:                                    # DT_STRTAB: a virtual address
                strtab = val
        if strtab is None:
            return None
        base = next(off + strtab - va for va, off, size in loads if va <= strtab < va + size)
        return [data[base + n:data.index(b"\0", base + n)].decode() for n in needed]
    except (struct.error, StopIteration, ValueError, UnicodeDecodeError):
        return None


def links_libstdcxx_statically(cxx: str | None = None) -> bool:
    """True when `cxx` links a shared object that uses libstdc++ without
    needing libstdc++.so (the library went in statically). False when it
    needs it, and when the probe cannot be built or read (no change then)."""
    cxx = cxx or compiler()
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = os.path.join(tmp, "probe.cpp"), os.path.join(tmp, "probe.so")
        with open(src, "w") as f:
            f.write(_PROBE)
        try:
            built = subprocess.run([*cxx.split(), "-shared", "-fPIC", "-O1", src, "-o", lib],
                                   capture_output=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            return False
        if built.returncode != 0:
            return False
        return lacks_shared_libstdcxx(lib)


def loaded_libstdcxx() -> str | None:
    """The shared libstdc++ this process has mapped (torch's, once torch is imported)."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1]
                if os.path.basename(path).startswith("libstdc++.so") and os.path.isfile(path):
                    return path
    except OSError:
        pass
    return None


def lacks_shared_libstdcxx(path: str) -> bool:
    """True when the built shared object at `path` does not need libstdc++.so
    (False when that cannot be read)."""
    needed = needed_libraries(path)
    return needed is not None and not any(n.startswith("libstdc++") for n in needed)


def libstdcxx_to_link(cxx: str | None = None) -> str | None:
    """The shared libstdc++ to put on _C's link line, or None where the
    compiler already links it as a shared library (or none is loaded)."""
    if not links_libstdcxx_statically(cxx):
        return None
    return loaded_libstdcxx()


def built_extension() -> str | None:
    """The in-place build of dllm_ops._C, if there is one."""
    import glob

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(root, "dllm_ops", "_C*.so")))
    return found[0] if found else None


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--check"]:
        ext = built_extension()
        if ext is None or lacks_shared_libstdcxx(ext):
            print(f"libstdcxx: {ext or 'dllm_ops/_C*.so'}: "
                  + ("no build" if ext is None else "libstdc++ is linked in statically, not needed "
                     "as torch's shared library: its error messages would crash"))
            sys.exit(1)
        if needed_libraries(ext) is None:
            print(f"libstdcxx: {ext}: not checked (not a 64-bit little-endian ELF file)")
        else:
            print(f"libstdcxx: {ext} needs the shared libstdc++ (as torch does)")
    else:
        print(libstdcxx_to_link() or "")
