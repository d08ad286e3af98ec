"""tests/plugins/requirements.py in a real pytest run (pytester, in process): a test marked `root` or
`netns` is skipped with its reason when not root and runs as root; a `network` test is skipped naming
the host it could not reach; a mark without its reason is a usage error, not a silent skip."""
from __future__ import annotations

import os
import socket

import pytest

pytest_plugins = ["pytester"]

MARKED = """
import pytest

@pytest.mark.root("mounts a tmpfs")
def test_mounts():
    pass

@pytest.mark.netns
def test_namespaces():
    pass

@pytest.mark.root("mounts a tmpfs")
@pytest.mark.netns
def test_both():
    pass

def test_plain():
    pass
"""


@pytest.fixture()
def suite(pytester: pytest.Pytester) -> pytest.Pytester:
    """A project whose conftest registers the hooks as tests/conftest.py does, with pyproject's netns marker."""
    pytester.makeconftest('pytest_plugins = ["tests.plugins.requirements"]\n')
    pytester.makeini("[pytest]\nmarkers =\n    netns: runs processes in Linux network namespaces (needs root)\n")
    return pytester


def run(suite: pytest.Pytester, source: str, euid: int, monkeypatch: pytest.MonkeyPatch) -> pytest.RunResult:
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    suite.makepyfile(test_marked=source)
    return suite.runpytest_inprocess("-rs", "-W", "error::pytest.PytestUnknownMarkWarning")


def test_without_root_each_marked_test_is_skipped_with_its_reason(suite, monkeypatch):
    result = run(suite, MARKED, 1000, monkeypatch)
    result.assert_outcomes(passed=1, skipped=3)
    result.stdout.fnmatch_lines_random([
        "SKIPPED*test_marked.py:*: needs root: mounts a tmpfs",
        "SKIPPED*test_marked.py:*: needs root: runs processes in Linux network namespaces",
        "SKIPPED*test_marked.py:*: needs root: mounts a tmpfs; runs processes in Linux network namespaces",
    ])


def test_as_root_every_marked_test_runs(suite, monkeypatch):
    run(suite, MARKED, 0, monkeypatch).assert_outcomes(passed=4)


def test_a_network_test_is_skipped_naming_the_host_it_could_not_reach(suite, monkeypatch):
    listening = socket.create_server(("127.0.0.1", 0))
    closed = socket.create_server(("127.0.0.1", 0))
    closed_port = closed.getsockname()[1]
    closed.close()  # nothing listens there now: the connect is refused
    try:
        result = run(suite, f"""
import pytest

@pytest.mark.network("127.0.0.1:{listening.getsockname()[1]}", "reaches a host that answers")
def test_reachable():
    pass

@pytest.mark.network("127.0.0.1:{closed_port}", "fetches a base image")
def test_unreachable():
    pass
""", 1000, monkeypatch)
    finally:
        listening.close()
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines([f"SKIPPED*needs the network (127.0.0.1:{closed_port} unreachable: "
                                 "ConnectionRefusedError*): fetches a base image"])


@pytest.mark.parametrize("mark", ['pytest.mark.root', 'pytest.mark.root("")', 'pytest.mark.network("why only")',
                                  'pytest.mark.network("why first", "host:1")'])
@pytest.mark.parametrize("euid", [0, 1000])
def test_a_mark_without_its_reason_is_a_usage_error(suite, monkeypatch, mark, euid):
    result = run(suite, f"import pytest\n\n@{mark}\ndef test_x():\n    pass\n", euid, monkeypatch)
    assert result.ret == pytest.ExitCode.USAGE_ERROR, result.stdout.str()
