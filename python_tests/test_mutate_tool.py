"""tools/mutate.py (`make mutate`) and its list tools/mutations.py.

The list is checked against the working tree here, in every `make test`: a
snippet that no longer occurs exactly once fails this file at once (the code
drifted; move the snippet with it), before anyone runs the mutations. The
tool itself is run end to end on a toy repository: a caught mutation, a
survivor, one whose snippet is missing and one whose snippet occurs twice.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import mutate  # noqa: E402


@pytest.fixture(scope="module")
def mutations():
    return mutate.load_mutations()


def test_the_list_is_valid_and_covers_cpp_and_python(mutations):
    mutate.validate(mutations)
    assert len(mutations) >= 40
    lanes = {mutate.how_of(m) for m in mutations}
    assert lanes == {"ctest", "ext", "pytest"}
    assert sum(m.file.startswith("csrc/") for m in mutations) >= 15
    assert sum(m.file.startswith("dllm_ops/") for m in mutations) >= 25
    assert any(m.fast for m in mutations) and not all(m.fast for m in mutations)


def test_every_snippet_occurs_exactly_once_in_the_tree(mutations):
    problems = {m.name: mutate.snippet_problem(ROOT, m) for m in mutations}
    assert {k: v for k, v in problems.items() if v} == {}


def test_every_selection_names_an_existing_test_file(mutations):
    for m in mutations:
        for t in m.tests:
            if t.startswith("ctest:"):
                assert t[6:] in mutate.CTEST_TARGETS, m.name
            else:
                assert os.path.isfile(os.path.join(ROOT, t.split("::")[0])), (m.name, t)
        if m.rebuild:
            assert os.path.isfile(os.path.join(ROOT, "csrc", "cpu", f"{m.rebuild}.cpp")), m.name


def test_the_required_survivors_of_issue_41_are_listed(mutations):
    names = {m.name for m in mutations}
    assert {"dream-threshold-carry-at-tau", "trace-never-resolves", "kvq-select-gain-sign",
            "d2cache-stage1-kth-mask-off-by-one"} <= names


def test_snippet_problem_reports_missing_repeated_and_absent_file(tmp_path):
    (tmp_path / "a.py").write_text("x = 1\nx = 1\ny = 2\n")
    class M_:
        def __init__(self, file, old):
            self.file, self.old = file, old

    assert mutate.snippet_problem(str(tmp_path), M_("a.py", "y = 2")) is None
    assert mutate.snippet_problem(str(tmp_path), M_("a.py", "x = 1")) == \
        "snippet occurs 2 times in a.py (must be exactly once)"
    assert mutate.snippet_problem(str(tmp_path), M_("a.py", "z = 3")) == \
        "snippet occurs 0 times in a.py (must be exactly once)"
    assert mutate.snippet_problem(str(tmp_path), M_("b.py", "x")) == "b.py does not exist"


def test_table_format():
    rows = [mutate.Outcome("a-rule", "test_x.py::test_a[cpu]", mutate.CAUGHT, 3.4),
            mutate.Outcome("b-rule", "ctest sim_kernels", mutate.SURVIVED, 20.0),
            mutate.Outcome("c|rule", "x | y", mutate.NOT_APPLIED)]
    assert mutate.format_table(rows, 90.0) == textwrap.dedent("""\
        | mutation | caught by | result |
        |---|---|---|
        | a-rule | test_x.py::test_a[cpu] | caught (3 s) |
        | b-rule | ctest sim_kernels | SURVIVED |
        | c|rule | x \\| y | NOT APPLIED |

        1 of 3 mutations caught in 1.5 min wall""")


TOY_CODE = """\
def commits(score, tau):
    return score >= tau


def best(xs):
    return max(xs)
"""

TOY_TEST = """\
from calc import best, commits


def test_commits_at_tau():
    assert commits(0.5, 0.5)
    assert not commits(0.4, 0.5)


def test_best():
    assert best([1, 3, 2]) >= 1
"""

TOY_LIST = """\
from dataclasses import dataclass


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple
    rule: str = ""
    fast: bool = False
    rebuild: str | None = None


MUTATIONS = [
    Mutation("ge-at-tau", "calc.py", "score >= tau", "score > tau", ("test_calc.py::test_commits_at_tau",)),
    Mutation("best-is-max", "calc.py", "return max(xs)", "return min(xs)", ("test_calc.py::test_best",)),
    Mutation("gone", "calc.py", "return abs(xs)", "return xs", ("test_calc.py::test_best",)),
    Mutation("twice", "calc.py", "return ", "return -", ("test_calc.py::test_best",)),
]
"""


def _toy_repository(tmp_path):
    """A git repository holding the toy code, its tests and its mutation list."""
    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "calc.py").write_text(TOY_CODE)
    (repo / "test_calc.py").write_text(TOY_TEST)
    (repo / "mutations.py").write_text(TOY_LIST)
    subprocess.run(["git", "init", "-q"], cwd=repo, check=True)
    return repo


def test_end_to_end_on_a_toy_repository(tmp_path, capsys):
    repo = _toy_repository(tmp_path)
    rc = mutate.main(["--root", str(repo), "--mutations", str(repo / "mutations.py"),
                      "--scratch", str(tmp_path / "scratch"), "--python", sys.executable,
                      "--timeout", "120", "--table", str(tmp_path / "table.md")])
    out = capsys.readouterr().out
    assert rc == 1, out                       # a survivor and two that do not apply
    table = (tmp_path / "table.md").read_text()
    lines = table.splitlines()
    assert lines[:2] == ["| mutation | caught by | result |", "|---|---|---|"]
    rows = {ln.split(" | ")[0][2:]: ln for ln in lines[2:6]}
    assert rows["ge-at-tau"].startswith("| ge-at-tau | test_calc.py::test_commits_at_tau | caught (")
    assert rows["best-is-max"] == "| best-is-max | test_calc.py::test_best | SURVIVED |"
    assert rows["gone"] == "| gone | test_calc.py::test_best | NOT APPLIED |"
    assert rows["twice"] == "| twice | test_calc.py::test_best | NOT APPLIED |"
    assert lines[-1].startswith("1 of 4 mutations caught in ")
    assert "snippet occurs 0 times in calc.py" in out and "snippet occurs 2 times in calc.py" in out
    # The working tree is never touched; the copy is reverted after each mutation.
    assert (repo / "calc.py").read_text() == TOY_CODE
    assert (tmp_path / "scratch" / "py" / "calc.py").read_text() == TOY_CODE


def test_only_the_fast_subset_or_named_mutations_run(tmp_path, capsys):
    repo = _toy_repository(tmp_path)
    rc = mutate.main(["--root", str(repo), "--mutations", str(repo / "mutations.py"),
                      "--scratch", str(tmp_path / "scratch"), "--python", sys.executable,
                      "--only", "ge-at-tau"])
    assert rc == 0
    assert "1 of 1 mutations caught" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="unknown mutation"):
        mutate.main(["--root", str(repo), "--mutations", str(repo / "mutations.py"), "--only", "nope"])
