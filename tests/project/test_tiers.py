"""The tier rules of tests/conftest.py (docs/testing.md), run by an inner pytest on small test files.

A tier a test evidently has (its fixtures, the names its code uses) but does not declare stops the
collection and names the file; a fast-tier test that launches ranks through a library call (which no
scan sees) fails. The launcher is replaced by a recorder, so nothing here starts a process.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from trtvocab.parallel import launch

CONFTEST = (Path(__file__).resolve().parents[1] / "conftest.py").read_text()

# A stand-in for a library call that launches ranks inside trtvocab (compare(tp=2), infer on a tp 2
# artifact): it lives outside the inner tests' folder, where the scan does not follow.
LIBRARY = '''
from trtvocab.parallel import launch


def compare_at_tp2():
    return launch.run_ranks(print, 2)
'''


@pytest.fixture
def inner(pytester: pytest.Pytester, tmp_path_factory: pytest.TempPathFactory,
          monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """A pytester folder with this suite's conftest, and a recording launcher behind ``run_ranks``."""
    pytester.makeconftest(CONFTEST)
    lib = tmp_path_factory.mktemp("library")
    (lib / "fake_library.py").write_text(LIBRARY)
    monkeypatch.syspath_prepend(str(lib))
    launches: list[int] = []
    monkeypatch.setattr(launch, "run_ranks", lambda fn, world, *a, **kw: launches.append(world) or [None] * world)
    pytester.launches = launches  # type: ignore[attr-defined]
    return pytester


def test_an_undeclared_tier_stops_the_collection_naming_the_file(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_undeclared=textwrap.dedent("""
        import subprocess

        def test_runs_a_child():
            subprocess.run(["true"], check=True)

        def test_needs_ranks(launch_ranks):
            pass

        def test_plain():
            pass
    """))
    result = inner.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*test_undeclared.py: tests whose tiers are not declared*",
                                 "*test_runs_a_child: subprocess (the name 'subprocess' in test_runs_a_child)",
                                 "*test_needs_ranks: ranks (the fixture 'launch_ranks')"])
    assert "test_plain" not in result.stderr.str()


def test_declared_tiers_imply_slow(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_declared=textwrap.dedent("""
        import subprocess

        import pytest

        @pytest.mark.subprocess
        def test_runs_a_child():
            subprocess.run(["true"], check=True)

        @pytest.mark.ranks
        def test_needs_ranks(launch_ranks):
            pass

        def test_plain():
            pass
    """))
    result = inner.runpytest_inprocess("--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not slow")
    assert result.ret == pytest.ExitCode.OK
    result.stdout.fnmatch_lines(["test_declared.py::test_plain", "1/3 tests collected (2 deselected)*"])


def test_a_fast_test_that_launches_ranks_fails(inner: pytest.Pytester) -> None:
    inner.makepyfile(test_launching=textwrap.dedent("""
        import fake_library
        import pytest

        @pytest.fixture
        def compared():
            return fake_library.compare_at_tp2()

        def test_fast_body():
            fake_library.compare_at_tp2()

        def test_fast_fixture(compared):
            pass

        def test_fast_that_catches():
            try:
                fake_library.compare_at_tp2()
            except BaseException:
                pass

        @pytest.mark.ranks
        def test_declared():
            fake_library.compare_at_tp2()
    """))
    result = inner.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=2, errors=1)
    result.stdout.fnmatch_lines_random([
        "*test_fast_body launched ranks (1 launch(es)) but is in the fast tier*",
        "*test_fast_fixture launched ranks (1 launch(es)) but is in the fast tier*",
        "*test_fast_that_catches launched ranks (1 launch(es)) but is in the fast tier*"])
    assert inner.launches == [2, 2, 2, 2]  # type: ignore[attr-defined]
