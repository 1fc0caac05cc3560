"""`make mutate`: plant each named bug of tools/mutations.py in a scratch copy
of the tree, one at a time, run the tests that must catch it, and print a table

    | mutation | caught by | result |

A test suite is as strong as the bugs it catches (docs/design.md). The list is
written by hand, reviewed like code, and grows with every op and method
(docs/adding-an-op.md, "Mutations"). Nothing here ever writes to the working
tree: each run syncs the tracked and untracked-not-ignored files into
``build/mutate/<lane>/`` (kept between runs, so C++ builds there are
incremental) and mutates only that copy.

Two lanes run side by side, each on its own copy (docs/mutations.md):
- ``py``: mutations caught by pytest node ids. The copy gets the working
  tree's built extension (``dllm_ops/_C*.so``; ``make build`` first), so a
  Python mutation costs one pytest start and its tests;
- ``cpp``: mutations caught by ctest's torch-free targets (``sim_kernels``,
  the CUDA kernels on the CUDA simulator against host loops; ``dllm_math``),
  configured once with CMake at -O0 and rebuilt incrementally: one
  translation unit per mutation, no torch headers (~5-10 s); and the
  ``rebuild="<family>"`` mutations: a CPU-only op library built once in the
  copy, relinked with the mutated ``csrc/cpu/<family>.cpp``, under the
  ``[cpu]`` pytest node ids (~15 s).

Results: ``caught`` (the selected tests fail), ``SURVIVED`` (they pass: a
missing test), ``NOT APPLIED`` (the snippet does not occur exactly once in the
file: the code drifted and the list must follow it), ``BUILD FAILED`` (the
mutant does not compile, so it proves nothing), ``ERROR`` (pytest could not
collect or run the selection), ``TIMEOUT``, and ``BASELINE FAILED`` (the
selection already fails without the mutation). Only ``caught`` counts as
caught; the exit status is 0 only when every mutation selected is caught.

    python tools/mutate.py               # every mutation (make mutate)
    python tools/mutate.py --fast        # the CI subset (make mutate-fast)
    python tools/mutate.py --only NAME   # one or more by name (repeatable)
    python tools/mutate.py --lane cpp    # only the C++ (or py: Python) mutations
    python tools/mutate.py --list        # the list, no runs
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# ctest name -> the CMake target that builds it (CMakeLists.txt).
CTEST_TARGETS = {"sim_kernels": "test_sim_kernels", "dllm_math": "test_dllm_math"}

CAUGHT = "caught"
SURVIVED = "SURVIVED"
NOT_APPLIED = "NOT APPLIED"
BUILD_FAILED = "BUILD FAILED"
ERROR = "ERROR"
TIMEOUT = "TIMEOUT"
BASELINE_FAILED = "BASELINE FAILED"


@dataclass
class Outcome:
    name: str
    caught_by: str
    result: str
    seconds: float = 0.0
    detail: str = ""


@dataclass
class Lane:
    """One scratch copy and the mutations run in it, in list order."""
    name: str
    tree: str
    mutations: list = field(default_factory=list)


# ---- the list ------------------------------------------------------------------

def load_mutations(path: str | None = None):
    """The ``MUTATIONS`` list of tools/mutations.py (or of the module at ``path``)."""
    import importlib.util

    path = path or os.path.join(HERE, "mutations.py")
    spec = importlib.util.spec_from_file_location("dllm_mutations", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return list(mod.MUTATIONS)


def validate(mutations) -> None:
    """Names unique, every mutation has tests of one kind and a real change."""
    seen = set()
    for m in mutations:
        if m.name in seen:
            raise SystemExit(f"mutate: mutation name {m.name!r} is used twice")
        seen.add(m.name)
        if not m.tests:
            raise SystemExit(f"mutate: {m.name}: no tests select it")
        kinds = {kind_of(t) for t in m.tests}
        if len(kinds) != 1:
            raise SystemExit(f"mutate: {m.name}: mixes ctest and pytest selections")
        if getattr(m, 'rebuild', None) is not None and kinds != {"py"}:
            raise SystemExit(f"mutate: {m.name}: rebuild= runs pytest node ids, not ctest")
        for t in m.tests:
            if kind_of(t) == "cpp" and t.split(":", 1)[1] not in CTEST_TARGETS:
                raise SystemExit(f"mutate: {m.name}: unknown ctest {t!r}; known: {sorted(CTEST_TARGETS)}")
        if m.old == m.new:
            raise SystemExit(f"mutate: {m.name}: the replacement equals the snippet")


def kind_of(test: str) -> str:
    return "cpp" if test.startswith("ctest:") else "py"


def lane_of(m) -> str:
    """'cpp' (compiles: ctest targets, or a rebuilt CPU family) or 'py'."""
    return "cpp" if getattr(m, "rebuild", None) is not None else kind_of(m.tests[0])


def how_of(m) -> str:
    """How a mutation is tested: 'ctest', 'ext' (rebuilt CPU family + pytest) or 'pytest'."""
    if getattr(m, "rebuild", None) is not None:
        return "ext"
    return "ctest" if kind_of(m.tests[0]) == "cpp" else "pytest"


def caught_by(m) -> str:
    """The table's "caught by" cell: the selection, without the python_tests/ prefix."""
    rebuild = getattr(m, "rebuild", None)
    parts = [f"(CPU {rebuild} rebuilt)"] if rebuild else []
    for t in m.tests:
        if t.startswith("ctest:"):
            parts.append(f"ctest {t[6:]}")
        else:
            parts.append(t[len("python_tests/"):] if t.startswith("python_tests/") else t)
    return ", ".join(parts)


def count_snippet(root: str, m) -> int:
    """How often ``m.old`` occurs in ``m.file`` (-1: no such file)."""
    path = os.path.join(root, m.file)
    if not os.path.isfile(path):
        return -1
    with open(path, encoding="utf-8") as f:
        return f.read().count(m.old)


def snippet_problem(root: str, m) -> str | None:
    """None when the snippet occurs exactly once, else why the mutation cannot apply."""
    n = count_snippet(root, m)
    if n == 1:
        return None
    if n < 0:
        return f"{m.file} does not exist"
    return f"snippet occurs {n} times in {m.file} (must be exactly once)"


# ---- the table -----------------------------------------------------------------

def format_table(outcomes, seconds: float | None = None) -> str:
    """Markdown table ``| mutation | caught by | result |`` plus a summary line."""
    lines = ["| mutation | caught by | result |", "|---|---|---|"]
    for o in outcomes:
        cell = o.caught_by.replace("|", "\\|")
        res = o.result if o.result != CAUGHT else f"caught ({o.seconds:.0f} s)"
        lines.append(f"| {o.name} | {cell} | {res} |")
    n_caught = sum(o.result == CAUGHT for o in outcomes)
    tail = f"{n_caught} of {len(outcomes)} mutations caught"
    if seconds is not None:
        tail += f" in {seconds / 60:.1f} min wall"
    lines.append("")
    lines.append(tail)
    return "\n".join(lines)


# ---- scratch copies ------------------------------------------------------------

def tree_files(root: str) -> list[str]:
    """Tracked and untracked-but-not-ignored files of the working tree."""
    out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                         check=True, capture_output=True).stdout
    return sorted({p for p in out.decode().split("\0") if p and os.path.isfile(os.path.join(root, p))})


def sync_tree(root: str, dest: str) -> int:
    """Make ``dest`` hold the working tree's files; unchanged files keep their
    mtime (incremental builds), files gone from the tree are removed. Returns
    how many files were written."""
    os.makedirs(dest, exist_ok=True)
    manifest_path = os.path.join(dest, ".mutate-manifest.json")
    old = []
    if os.path.exists(manifest_path):
        with open(manifest_path) as f:
            old = json.load(f)
    files = tree_files(root)
    written = 0
    for rel in files:
        src, dst = os.path.join(root, rel), os.path.join(dest, rel)
        with open(src, "rb") as f:
            data = f.read()
        if os.path.isfile(dst):
            with open(dst, "rb") as f:
                if f.read() == data:
                    continue
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        with open(dst, "wb") as f:
            f.write(data)
        shutil.copymode(src, dst)
        written += 1
    keep = set(files)
    for rel in old:
        if rel not in keep and os.path.isfile(os.path.join(dest, rel)):
            os.remove(os.path.join(dest, rel))
    with open(manifest_path, "w") as f:
        json.dump(files, f)
    return written


def copy_extension(root: str, tree: str) -> None:
    """The working tree's built extension, for the Python lane (never rebuilt there)."""
    pkg = os.path.join(root, "dllm_ops")
    if not os.path.isdir(pkg):
        return  # not this project (the tool's own tests run it on a toy tree)
    libs = [n for n in os.listdir(pkg) if n.startswith("_C") and n.endswith(".so")]
    if not libs:
        raise SystemExit("mutate: dllm_ops/_C*.so is missing: run `make build` first")
    for n in os.listdir(os.path.join(tree, "dllm_ops")):
        if n.startswith("_C") and n.endswith(".so") and n not in libs:
            os.remove(os.path.join(tree, "dllm_ops", n))
    for n in libs:
        src, dst = os.path.join(pkg, n), os.path.join(tree, "dllm_ops", n)
        if not os.path.exists(dst) or _digest(src) != _digest(dst):
            shutil.copy2(src, dst)


def _digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


class Mutant:
    """Context manager: ``m`` applied to the copy ``tree``, reverted on exit."""

    def __init__(self, tree: str, m):
        self.path = os.path.join(tree, m.file)
        self.m = m

    def __enter__(self):
        with open(self.path, encoding="utf-8") as f:
            self.text = f.read()
        if self.text.count(self.m.old) != 1:
            raise RuntimeError(f"{self.m.name}: the snippet no longer occurs once in the copy")
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(self.text.replace(self.m.old, self.m.new, 1))
        return self

    def __exit__(self, *exc):
        with open(self.path, "w", encoding="utf-8") as f:
            f.write(self.text)
        return False


# ---- running tests -------------------------------------------------------------

class Runner:
    """Runs a lane's tests in its copy (subprocesses; ``log`` gets their output)."""

    def __init__(self, python: str, timeout: float, log_dir: str, threads: int | None):
        self.python = python
        self.timeout = timeout
        self.log_dir = log_dir
        self.threads = threads
        self.lock = threading.Lock()

    def _run(self, cmd, cwd, log_name, env=None, capture=False):
        """(returncode or None on timeout, seconds[, output]); output appended to the log."""
        t0 = time.perf_counter()
        log = os.path.join(self.log_dir, log_name)
        try:
            p = subprocess.run(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                               timeout=self.timeout)
            rc, text = p.returncode, p.stdout.decode(errors="replace")
        except subprocess.TimeoutExpired as e:
            rc, text = None, (e.stdout or b"").decode(errors="replace") + "\n[timeout]\n"
        with self.lock, open(log, "a") as f:
            f.write(f"\n$ {' '.join(cmd)}\n{text}")
        if capture:
            return rc, time.perf_counter() - t0, text
        return rc, time.perf_counter() - t0

    def pytest_env(self, tree: str, library: str | None = None) -> dict:
        env = dict(os.environ)
        env["PYTHONPATH"] = tree + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        env.pop("DLLM_OPS_LIBRARY", None)  # the copy's own extension ...
        if library:
            env["DLLM_OPS_LIBRARY"] = library  # ... or the rebuilt CPU library
        env.pop("PYTEST_ADDOPTS", None)
        if self.threads:
            env["OMP_NUM_THREADS"] = str(self.threads)
        return env

    def pytest(self, tree: str, tests, log_name: str, library: str | None = None):
        """pytest's return code: 0 passed, 1 a test failed, others: could not run."""
        cmd = [self.python, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "--no-header",
               "-rN", *tests]
        return self._run(cmd, tree, log_name, env=self.pytest_env(tree, library))

    def collect(self, tree: str, tests, log_name: str, library: str | None = None) -> set[str]:
        """The node ids pytest collects from the files of ``tests`` (one run; a
        missing file or one that does not import contributes none)."""
        files = sorted({t.split("::")[0] for t in tests if os.path.isfile(os.path.join(tree, t.split("::")[0]))})
        if not files:
            return set()
        cmd = [self.python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *files]
        _, _, text = self._run(cmd, tree, log_name, env=self.pytest_env(tree, library), capture=True)
        return {ln.strip() for ln in text.splitlines() if "::" in ln and not ln.startswith(("ERROR", "FAILED"))}

    def pytest_failures(self, tree: str, tests, log_name: str, library: str | None = None):
        """(rc, node ids that failed or errored) of one run of ``tests`` without -x."""
        cmd = [self.python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--no-header", "-rfE",
               *tests]
        rc, _, text = self._run(cmd, tree, log_name, env=self.pytest_env(tree, library), capture=True)
        bad = set()
        for ln in text.splitlines():
            for tag in ("FAILED ", "ERROR "):
                if ln.startswith(tag):
                    bad.add(ln[len(tag):].split(" - ")[0].strip())
        return rc, bad

    # The copy's CMake build compiles at -O0 without debug info: the simulator
    # driver then builds in ~5 s instead of ~16 s (-O2 -g) and still runs in
    # well under a second; a mutation costs its compile, not its run.
    CMAKE_ARGS = ("-DCMAKE_BUILD_TYPE=None", "-DCMAKE_CXX_FLAGS=-O0")

    def cmake_configure(self, tree: str) -> bool:
        build = os.path.join(tree, "build", "cmake")
        cache = os.path.join(build, "CMakeCache.txt")
        if os.path.exists(cache):
            with open(cache) as f:
                if "CMAKE_CXX_FLAGS:STRING=-O0" in f.read():
                    return True
            shutil.rmtree(build)   # configured otherwise (an older run): start over
        rc, _ = self._run(["bash", os.path.join(tree, "scripts", "cmake_configure.sh"), self.python,
                           build, *self.CMAKE_ARGS], tree, "cpp.log")
        return rc == 0

    def ctest(self, tree: str, tests, log_name: str):
        """('build', rc) when a target does not build, else ('test', ctest rc)."""
        build = os.path.join(tree, "build", "cmake")
        names = [t.split(":", 1)[1] for t in tests]
        total = 0.0
        for n in names:
            rc, s = self._run(["cmake", "--build", build, "--target", CTEST_TARGETS[n]], tree, log_name)
            total += s
            if rc != 0:
                return "build", rc, total
        regex = "^(" + "|".join(names) + ")$"
        rc, s = self._run(["ctest", "--test-dir", build, "-R", regex, "--output-on-failure"], tree,
                          log_name)
        return "test", rc, total + s


class ExtBuilder:
    """A CPU-only op library for the ``rebuild=`` mutations: ``csrc/ops.cpp`` and
    every ``csrc/cpu/*.cpp`` of a copy,
    compiled at -O1 (the tests are the same; the compile is the cost) and
    loaded by pytest through ``DLLM_OPS_LIBRARY``. Clean objects are kept under
    ``build/mutate-ext`` of the copy and rebuilt only when ``csrc/`` changed; a
    mutation recompiles its family's translation unit and relinks."""

    def __init__(self, tree: str, runner: "Runner", families):
        self.tree = tree
        self.runner = runner
        self.families = sorted(set(families))
        self.dir = os.path.join(tree, "build", "mutate-ext")
        self._flags = None

    def flags(self):
        if self._flags is None:
            code = ("import json, sysconfig, torch\n"
                    "from torch.utils import cpp_extension as c\n"
                    "print(json.dumps(dict(inc=c.include_paths(), lib=c.library_paths(),\n"
                    "  py=sysconfig.get_paths()['include'], abi=int(torch._C._GLIBCXX_USE_CXX11_ABI))))")
            out = subprocess.run([self.runner.python, "-c", code], check=True, capture_output=True,
                                 text=True).stdout
            self._flags = json.loads(out.strip().splitlines()[-1])
        return self._flags

    def _compile_cmd(self, src: str, obj: str):
        f = self.flags()
        cmd = ["c++", "-std=c++20", "-O1", "-fPIC", "-fopenmp", "-Wno-unknown-pragmas",
               f"-D_GLIBCXX_USE_CXX11_ABI={f['abi']}", "-DTORCH_API_INCLUDE_EXTENSION_H",
               "-DTORCH_EXTENSION_NAME=_C", "-I", os.path.join(self.tree, "csrc")]
        for inc in f["inc"] + [f["py"]]:
            cmd += ["-I", inc]
        return cmd + ["-c", os.path.join(self.tree, src), "-o", obj]

    def _link(self, objs, lib: str, log: str) -> bool:
        f = self.flags()
        cmd = ["c++", "-shared", "-fopenmp", *objs, "-o", lib]
        for d in f["lib"]:
            cmd += ["-L", d, f"-Wl,-rpath,{d}"]
        cmd += ["-lc10", "-ltorch", "-ltorch_cpu"]
        rc, _ = self.runner._run(cmd, self.tree, log)
        return rc == 0

    def _sources(self):
        """Every CPU translation unit (kernels share helpers across families,
        e.g. the attention tile of sparse_kv.cpp that quant.cpp calls)."""
        cpu = os.path.join(self.tree, "csrc", "cpu")
        return ["csrc/ops.cpp"] + [f"csrc/cpu/{n}" for n in sorted(os.listdir(cpu)) if n.endswith(".cpp")]

    def _stamp(self) -> str:
        h = hashlib.sha256(json.dumps([self.flags(), self._sources()]).encode())
        csrc = os.path.join(self.tree, "csrc")
        for base, dirs, files in sorted(os.walk(csrc)):
            dirs.sort()
            for n in sorted(files):
                p = os.path.join(base, n)
                h.update(os.path.relpath(p, csrc).encode())
                with open(p, "rb") as fh:
                    h.update(fh.read())
        return h.hexdigest()

    def clean_lib(self, log: str) -> str | None:
        """The unmutated library (built when csrc/ changed); None if it does not build."""
        clean = os.path.join(self.dir, "clean")
        os.makedirs(clean, exist_ok=True)
        stamp_path = os.path.join(clean, "stamp")
        stamp = self._stamp()
        lib = os.path.join(clean, "libdllm_mutate.so")
        if os.path.exists(lib) and os.path.exists(stamp_path) and open(stamp_path).read() == stamp:
            return lib
        if os.path.exists(stamp_path):
            os.remove(stamp_path)
        objs = []
        for src in self._sources():
            obj = os.path.join(clean, os.path.basename(src)[:-4] + ".o")
            rc, _ = self.runner._run(self._compile_cmd(src, obj), self.tree, log)
            if rc != 0:
                return None
            objs.append(obj)
        if not self._link(objs, lib, log):
            return None
        with open(stamp_path, "w") as fh:
            fh.write(stamp)
        return lib

    def mutant_lib(self, family: str, log: str) -> str | None:
        """The library with ``csrc/cpu/<family>.cpp`` recompiled from the (mutated) copy."""
        clean = os.path.join(self.dir, "clean")
        mut = os.path.join(self.dir, "mutant")
        os.makedirs(mut, exist_ok=True)
        obj = os.path.join(mut, f"{family}.o")
        if os.path.exists(obj):
            os.remove(obj)
        rc, _ = self.runner._run(self._compile_cmd(f"csrc/cpu/{family}.cpp", obj), self.tree, log)
        if rc != 0:
            return None
        objs = [obj if os.path.basename(s)[:-4] == family else os.path.join(clean, os.path.basename(s)[:-4] + ".o")
                for s in self._sources()]
        lib = os.path.join(mut, "libdllm_mutate.so")
        return lib if self._link(objs, lib, log) else None


def verdict_pytest(rc) -> str:
    if rc is None:
        return TIMEOUT
    if rc == 0:
        return SURVIVED
    if rc == 1:
        return CAUGHT
    return ERROR  # 2 interrupted / collection error, 3 internal, 4 usage (no such test), 5 nothing collected


def _union(mutations) -> list[str]:
    tests = []
    for m in mutations:
        tests += [t for t in m.tests if t not in tests]
    return tests


def run_lane(lane: Lane, runner: Runner, report) -> list[Outcome]:
    """Per way of testing (ctest, rebuilt CPU family, pytest): a baseline of the
    union of the selections without mutations, then each mutation in order."""
    out = []
    log = f"{lane.name}.log"
    groups = {}
    for m in lane.mutations:
        groups.setdefault(how_of(m), []).append(m)
    ext = ExtBuilder(lane.tree, runner, [m.rebuild for m in groups.get("ext", [])])
    base_ok, why, clean_lib = {}, {}, None
    bad_tests: dict[str, str] = {}   # selection -> why its baseline is unusable
    for how, ms in groups.items():
        tests = _union(ms)
        if how == "ext":
            clean_lib = ext.clean_lib(log)
        if how == "pytest" or (how == "ext" and clean_lib is not None):
            found = runner.collect(lane.tree, tests, log, clean_lib if how == "ext" else None)
            for t in tests:
                if t not in found and not any(c.startswith(t + "[") for c in found):
                    bad_tests[t] = "no such test"
        if how == "pytest":
            run = [t for t in tests if t not in bad_tests]
            rc, failed = runner.pytest_failures(lane.tree, run, log) if run else (0, set())
            for t in run:
                if any(f == t or f.startswith(t + "[") for f in failed):
                    bad_tests[t] = "fails without the mutation"
            base_ok[how] = rc in (0, 1) or not run
            why[how] = f"pytest rc {rc}"
        elif how == "ctest":
            if not runner.cmake_configure(lane.tree):
                base_ok[how], why[how] = False, "cmake configure failed"
            else:
                stage, rc, _ = runner.ctest(lane.tree, tests, log)
                base_ok[how], why[how] = rc == 0, f"{stage} rc {rc}"
        else:
            if clean_lib is None:
                base_ok[how], why[how] = False, "the CPU library does not build"
            else:
                run = [t for t in tests if t not in bad_tests]
                rc, failed = runner.pytest_failures(lane.tree, run, log, clean_lib) if run else (0, set())
                for t in run:
                    if any(f == t or f.startswith(t + "[") for f in failed):
                        bad_tests[t] = "fails without the mutation"
                base_ok[how], why[how] = rc in (0, 1) or not run, f"pytest rc {rc}"
        n_bad = sum(t in bad_tests for t in tests)
        state = "ok" if base_ok[how] and not n_bad else \
            f"{n_bad} unusable" if base_ok[how] else f"FAILED ({why[how]}; see {log})"
        report(f"[{lane.name}] baseline {how} ({len(tests)} selections): {state}")
    for m in lane.mutations:
        how = how_of(m)
        unusable = [f"{t}: {bad_tests[t]}" for t in m.tests if t in bad_tests]
        if not base_ok[how] or unusable:
            if unusable and all(bad_tests[t] == "no such test" for t in m.tests if t in bad_tests):
                res, detail = ERROR, "; ".join(unusable)
            else:
                res, detail = BASELINE_FAILED, "; ".join(unusable) or why[how]
            out.append(Outcome(m.name, caught_by(m), res, 0.0, detail))
            report(f"[{lane.name}] {m.name}: {res} ({detail})")
            continue
        t0 = time.perf_counter()
        with open(os.path.join(runner.log_dir, log), "a") as f:
            f.write(f"\n==== mutation {m.name}: {m.file}\n")
        with Mutant(lane.tree, m):
            if how == "pytest":
                rc, _ = runner.pytest(lane.tree, list(m.tests), log)
                res = verdict_pytest(rc)
            elif how == "ctest":
                stage, rc, _ = runner.ctest(lane.tree, list(m.tests), log)
                if rc is None:
                    res = TIMEOUT
                elif stage == "build":
                    res = BUILD_FAILED
                else:
                    res = CAUGHT if rc != 0 else SURVIVED
            else:
                lib = ext.mutant_lib(m.rebuild, log)
                if lib is None:
                    res = BUILD_FAILED
                else:
                    rc, _ = runner.pytest(lane.tree, list(m.tests), log, library=lib)
                    res = verdict_pytest(rc)
        o = Outcome(m.name, caught_by(m), res, time.perf_counter() - t0)
        out.append(o)
        report(f"[{lane.name}] {m.name}: {res} ({o.seconds:.0f} s)")
    return out


# ---- main ----------------------------------------------------------------------

def default_python() -> str:
    venv = os.path.join(ROOT, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="only the mutations marked fast (CI)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME", help="run these (repeatable)")
    ap.add_argument("--lane", choices=("cpp", "py"), help="only the mutations of one lane")
    ap.add_argument("--list", action="store_true", help="print the list and exit")
    ap.add_argument("--root", default=ROOT, help="the tree to copy (default: this checkout)")
    ap.add_argument("--mutations", default=None, help="the list module (default tools/mutations.py)")
    ap.add_argument("--scratch", default=None, help="scratch folder (default <root>/build/mutate)")
    ap.add_argument("--python", default=None, help="interpreter for pytest (default .venv's)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per build / test run")
    ap.add_argument("--serial", action="store_true", help="run the lanes one after the other")
    ap.add_argument("--table", default=None, help="also write the table to this file")
    args = ap.parse_args(argv)

    mutations = load_mutations(args.mutations)
    validate(mutations)
    if args.only:
        unknown = sorted(set(args.only) - {m.name for m in mutations})
        if unknown:
            raise SystemExit(f"mutate: unknown mutation(s) {unknown}")
        mutations = [m for m in mutations if m.name in args.only]
    elif args.fast:
        mutations = [m for m in mutations if m.fast]
    if args.lane:
        mutations = [m for m in mutations if lane_of(m) == args.lane]
    if args.list:
        for m in mutations:
            print(f"{m.name:44s} {'fast ' if m.fast else '     '}{m.file}  ->  {caught_by(m)}")
        print(f"{len(mutations)} mutations")
        return 0

    root = os.path.abspath(args.root)
    scratch = os.path.abspath(args.scratch or os.path.join(root, "build", "mutate"))
    os.makedirs(scratch, exist_ok=True)
    python = args.python or default_python()
    t_start = time.perf_counter()
    lock = threading.Lock()

    def report(msg):
        with lock:
            print(f"{time.perf_counter() - t_start:6.0f} s  {msg}", flush=True)

    # Snippets are checked against the working tree before anything runs.
    outcomes: dict[str, Outcome] = {}
    runnable = []
    for m in mutations:
        problem = snippet_problem(root, m)
        if problem:
            outcomes[m.name] = Outcome(m.name, caught_by(m), NOT_APPLIED, 0.0, problem)
            report(f"{m.name}: {NOT_APPLIED}: {problem}")
        else:
            runnable.append(m)

    lanes = []
    for name in ("cpp", "py"):
        ms = [m for m in runnable if lane_of(m) == name]
        if ms:
            lanes.append(Lane(name, os.path.join(scratch, name), ms))
    for lane in lanes:
        n = sync_tree(root, lane.tree)
        if lane.name == "py":
            copy_extension(root, lane.tree)
        report(f"[{lane.name}] {len(lane.mutations)} mutations; copy synced ({n} files written)")
    for lane in lanes:
        open(os.path.join(scratch, f"{lane.name}.log"), "w").close()

    parallel = len(lanes) > 1 and not args.serial
    runner = Runner(python, args.timeout, scratch, threads=1 if parallel else None)
    if parallel:
        with cf.ThreadPoolExecutor(len(lanes)) as ex:
            for res in ex.map(lambda ln: run_lane(ln, runner, report), lanes):
                for o in res:
                    outcomes[o.name] = o
    else:
        for lane in lanes:
            for o in run_lane(lane, runner, report):
                outcomes[o.name] = o

    wall = time.perf_counter() - t_start
    ordered = [outcomes[m.name] for m in mutations]
    table = format_table(ordered, wall)
    print()
    print(table)
    for o in ordered:
        if o.result != CAUGHT and o.detail:
            print(f"  {o.name}: {o.detail}")
    if args.table:
        with open(args.table, "w") as f:
            f.write(table + "\n")
    print(f"logs: {scratch}/{{cpp,py}}.log")
    return 0 if all(o.result == CAUGHT for o in ordered) else 1


if __name__ == "__main__":
    sys.exit(main())
