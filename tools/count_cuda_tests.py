"""Which tests `make gpu-check` must run on the GPU, and whether its selection runs them.

    python tools/count_cuda_tests.py [--check] [--json] [-k EXPR] [-m EXPR] [PATH ...]

Two pytest collections (no test runs; no GPU needed):
  1. the suite under `-m EXPR`: every item whose parametrization has the
     device value "cuda" (a `backend`, `device` or `model_device` parameter,
     or any other) is a CUDA test;
  2. the same with `-k EXPR`: what gpu-check's pytest step selects.
Prints, per test file, the CUDA tests and the selected ones. With --check the
exit status is 1 when a CUDA test is not selected or nothing is selected, so
a `-k` expression that stops matching (a renamed parameter, an id= that hides
"cuda") fails gpu-check instead of passing with the method tests unrun.
Defaults: `-k "cuda and not cudasim" -m "not slow" python_tests`, gpu-check's.
"""
from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_K = "cuda and not cudasim"
DEFAULT_M = "not slow"


def _is_cuda(value) -> bool:
    """A parameter value that names the CUDA device ("cuda", torch.device("cuda"))."""
    if isinstance(value, (tuple, list)):
        return any(_is_cuda(v) for v in value)
    if isinstance(value, str):
        return value == "cuda"
    return type(value).__name__ == "device" and getattr(value, "type", None) == "cuda"


class _Collector:
    """A pytest plugin that keeps the node ids of the collected (selected) items."""

    def __init__(self):
        self.items = []
        self.errors = []

    def pytest_collection_finish(self, session):
        self.items = list(session.items)

    def pytest_collectreport(self, report):
        if report.failed:
            self.errors.append(report.nodeid)


def _collect(args: list[str]) -> _Collector:
    plugin = _Collector()
    quiet = io.StringIO()
    with contextlib.redirect_stdout(quiet):
        rc = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *args], plugins=[plugin])
    if rc not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED) or plugin.errors:
        sys.stderr.write(quiet.getvalue())
        raise SystemExit(f"count_cuda_tests: collection failed (exit {int(rc)}; errors in "
                         f"{', '.join(plugin.errors) or 'pytest'})")
    return plugin


def _file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def count(paths: list[str], keyword: str, marker: str) -> dict:
    """``{"files": {file: {"cuda": n, "selected": n}}, "unselected": [nodeid, ...], totals}``."""
    everything = _collect(["-m", marker, *paths])
    cuda = [it.nodeid for it in everything.items
            if any(_is_cuda(v) for v in getattr(getattr(it, "callspec", None), "params", {}).values())]
    selected = [it.nodeid for it in _collect(["-m", marker, "-k", keyword, *paths]).items]
    files: dict = collections.defaultdict(lambda: dict(cuda=0, selected=0))
    for nodeid in cuda:
        files[_file_of(nodeid)]["cuda"] += 1
    for nodeid in selected:
        files[_file_of(nodeid)]["selected"] += 1
    chosen = set(selected)
    return dict(keyword=keyword, marker=marker, files=dict(sorted(files.items())),
                cuda=len(cuda), selected=len(selected),
                unselected=[n for n in cuda if n not in chosen])


def check(result: dict) -> list[str]:
    """The reasons a gpu-check selection falls short (empty: it runs every CUDA test)."""
    problems = []
    if result["selected"] == 0:
        problems.append(f'-k "{result["keyword"]}" selects no test')
    if result["unselected"]:
        problems.append(f'{len(result["unselected"])} of the {result["cuda"]} CUDA-parametrized tests '
                        f'are not selected by -k "{result["keyword"]}", e.g. {result["unselected"][0]}')
    return problems


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/count_cuda_tests.py", description=__doc__.split("\n\n")[0])
    p.add_argument("paths", nargs="*", default=[os.path.join(ROOT, "python_tests")])
    p.add_argument("-k", dest="keyword", default=DEFAULT_K, help=f'selection (default "{DEFAULT_K}")')
    p.add_argument("-m", dest="marker", default=DEFAULT_M, help=f'marker filter (default "{DEFAULT_M}")')
    p.add_argument("--check", action="store_true", help="exit 1 unless every CUDA test is selected")
    p.add_argument("--json", action="store_true", help="print the counts as JSON")
    args = p.parse_args(argv)
    result = count(args.paths, args.keyword, args.marker)
    problems = check(result)
    if args.json:
        print(json.dumps(dict(result, problems=problems), indent=1))
    else:
        width = max([len(f) for f in result["files"]] + [len("total")])
        print(f'{"file":<{width}}  {"cuda-param":>10}  {"selected":>8}   (-k "{args.keyword}" -m "{args.marker}")')
        for f, n in result["files"].items():
            print(f'{f:<{width}}  {n["cuda"]:>10}  {n["selected"]:>8}')
        print(f'{"total":<{width}}  {result["cuda"]:>10}  {result["selected"]:>8}')
        for line in problems:
            print(f"count_cuda_tests: {line}")
    return 1 if args.check and problems else 0


if __name__ == "__main__":
    sys.exit(main())
