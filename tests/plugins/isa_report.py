"""pytest hooks: which instruction-set levels of the compiled kernels this run tested and skipped.

A test case says which level it covers with the marker `kernel_level(name)` (put on a parametrize or
fixture param with `pytest.param(..., marks=pytest.mark.kernel_level("avx2"))`); where the CPU, or the
PDSERVE_CPU_ISA cap, lacks the level, the case skips with `lacks(level, flag)` as its reason. The run
then ends with one line, e.g.

    kernel levels: tested c, avx2, avx512, avx512_bf16; skipped amx (CPU lacks amx_tile)

A level counts as tested when at least one of its cases ran (passed or failed), as skipped when every
case of it skipped. The level travels in each report's user_properties, so the line also adds up under
pytest-xdist (reports reach the controller) and without it.
"""
from __future__ import annotations

import os
import re
from collections.abc import Generator
from dataclasses import dataclass, field

import pytest

from pdserve.common import cpu_isa, env

# Only the hook below reaches tests/conftest.py's namespace (the rest are methods of a registered object): a
# second definition of a name there replaces the first, and tests/plugins/requirements.py exports pytest_addhooks.
__all__ = ["pytest_configure"]

MARKER = "kernel_level"
PLUGIN_NAME = "pdserve-isa-report"
ORDER = ("c", "avx2", "avx512", "avx512_bf16", "amx")  # narrowest first: the order of the summary
_REASON = re.compile(r"^(?P<level>\S+) needs (?P<flag>\S+); this CPU \(.*\)(?P<cap> capped at (?P<at>\S+) by "
                     r"(?P<var>\S+))? lacks it$")


def lacks(level: str, flag: str) -> str:
    """The skip reason of a case at `level` on a CPU that does not show `flag` (hidden by the cap, or absent)."""
    capped = cpu_isa.cap()
    where = ""
    if capped is not None and flag in cpu_isa.cpu_flags():
        var = cpu_isa.ENV if env.value(env.CPU_ISA).strip() else cpu_isa.ONEDNN_ENV
        where = f" capped at {capped} by {var}"
    return f"{level} needs {flag}; this CPU ({cpu_isa.model_name()}){where} lacks it"


def _why(reason: str) -> str:
    """A skip reason as the summary line puts it: 'CPU lacks avx512f', 'PDSERVE_CPU_ISA=avx2 hides avx512f' (any
    other reason as it is)."""
    reason = reason.removeprefix("Skipped: ")
    m = _REASON.match(reason)
    if m is None:
        return reason
    if not m["cap"]:
        return f"CPU lacks {m['flag']}"
    return f"{m['var']}={os.environ.get(m['var'], m['at']).strip()} hides {m['flag']}"


@dataclass
class _Tally:
    tested: set[str] = field(default_factory=set)
    skipped: dict[str, str] = field(default_factory=dict)  # level -> the first skip reason given
    errored: set[str] = field(default_factory=set)

    def line(self) -> str | None:
        levels = sorted(self.tested | set(self.skipped) | self.errored,
                        key=lambda lvl: (ORDER.index(lvl) if lvl in ORDER else len(ORDER), lvl))
        if not levels:
            return None
        tested = [lvl for lvl in levels if lvl in self.tested]
        skipped = [f"{lvl} ({_why(self.skipped[lvl])})" for lvl in levels
                   if lvl in self.skipped and lvl not in self.tested and lvl not in self.errored]
        errored = [lvl for lvl in levels if lvl in self.errored and lvl not in self.tested]
        line = f"kernel levels: tested {', '.join(tested) or 'none'}; skipped {', '.join(skipped) or 'none'}"
        return line + (f"; not run for errors {', '.join(errored)}" if errored else "")


class _IsaReport:
    """The hooks that add up and print the levels, as methods of one registered object (see __all__)."""

    def __init__(self) -> None:
        self.tally = _Tally()

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        for item in items:
            marker = item.get_closest_marker(MARKER)
            if marker is not None:
                item.user_properties.append((MARKER, marker.args[0]))

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        level = next((value for name, value in report.user_properties if name == MARKER), None)
        if level is None:
            return
        if report.skipped and not hasattr(report, "wasxfail"):
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.tally.skipped.setdefault(level, reason)
        elif report.when == "call":
            self.tally.tested.add(level)
        elif report.failed:  # setup or teardown: the case's build or fixture failed, so it did not run
            self.tally.errored.add(level)

    # The outermost wrapper: the line comes after the terminal reporter's own summary (-ra's skip reasons), just
    # above the final counts.
    @pytest.hookimpl(wrapper=True, tryfirst=True)
    def pytest_terminal_summary(self, terminalreporter) -> Generator[None, None, None]:
        try:
            return (yield)
        finally:
            line = self.tally.line()
            if line is not None:
                terminalreporter.write_line(line)


def pytest_configure(config: pytest.Config) -> None:
    """Register the marker, and the report's hooks as a plugin of their own (once: conftest is loaded once)."""
    config.addinivalue_line("markers", f"{MARKER}(name): the instruction-set level of the compiled kernels this "
                                       f"case covers ({', '.join(ORDER)}); the run ends with the levels tested")
    if config.pluginmanager.get_plugin(PLUGIN_NAME) is None:
        config.pluginmanager.register(_IsaReport(), PLUGIN_NAME)
