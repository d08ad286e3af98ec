"""Every PDSERVE_* environment variable a pdserve process reads: name, type, default and meaning, once.

Modules read them only through the accessors below (never `os.environ` directly), so a variable's
name, default and spelling rules cannot drift apart between its readers, and docs/configuration.md's
table is this table: `python -m pdserve.common.env` prints it, tests/common/test_env.py checks the docs hold it.
What a value means (the choices of PDSERVE_KERNELS, the levels of PDSERVE_CPU_ISA) stays with the module
that acts on it, which validates it with its own message; this module only says what was set.

Unset means the default. An empty value also means the default, except where its reader says otherwise
(PDSERVE_KERNELS refuses an empty value as it refuses any other unknown backend).
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Variable:
    """One PDSERVE_* variable. `default` is the value an unset variable has ("" for none); `kind` its
    type as the docs state it; `doc` what it does, one line of docs/configuration.md."""

    name: str
    kind: str
    default: str
    doc: str


CACHE_DIR = Variable(
    "PDSERVE_CACHE_DIR", "path", "~/.cache/pdserve",
    "where built-in models, compiled kernels and the default file store live (`common/paths.py`)")
API_KEY = Variable(
    "PDSERVE_API_KEY", "string", "",
    "default of a P/D node's `--api-key`: the key pd-proxy (gRPC) and HTTP clients of the node must send")
NODE_API_KEY = Variable(
    "PDSERVE_NODE_API_KEY", "string", "",
    "default of pd-proxy's `--node-api-key`: the key it sends to the nodes")
EVENT_LOOP = Variable(
    "PDSERVE_EVENT_LOOP", "`uvloop` \\| `asyncio`", "uvloop",
    "the event loop of every process; `asyncio` runs asyncio's own instead of uvloop (`common/eventloop.py`)")
KERNELS = Variable(
    "PDSERVE_KERNELS", "`auto` \\| `triton` \\| `torch`", "auto",
    "force the kernel path: `torch` keeps every compiled path off (the references run), `triton` forces "
    "Triton, its interpreter on CPU (`common/kernel_choice.py`)")
LINEAR = Variable(
    "PDSERVE_LINEAR", "`auto` \\| `PATH` \\| `SMALL,LARGE`", "auto",
    "name the bf16 linear path (for decode-sized and prefill-sized calls) instead of the start-up "
    "measurement's choice; an unknown or unavailable path is a start-up error (`kernels/linear_choice.py`)")
CPU_ISA = Variable(
    "PDSERVE_CPU_ISA", "`native` \\| `x86-64` \\| `avx2` \\| `avx512` \\| `avx512_bf16`", "",
    "cap the instruction level the C kernels are built for and the linear paths measured, so one CPU stands "
    "in for a smaller kind; unset: follows `ONEDNN_MAX_CPU_ISA` (`common/cpu_isa.py`, "
    "[benchmarks.md](benchmarks.md) lists each kind's variables)")
CONFIGURE_LOGGING = Variable(
    "PDSERVE_CONFIGURE_LOGGING", "boolean", "1",
    "`0` (or `false`, `no`, `off`): the offline `LLM` leaves logging alone (by default it prints its lines "
    "to stdout, like vLLM)")
SHARED_CORES = Variable(
    "PDSERVE_SHARED_CORES", "boolean", "0",
    "`1`: other engines share this engine's cores (a launcher that packs engines onto one host says so; "
    "`LocalCluster` does), and its `threads:` line says so; its OpenMP workers wait passively "
    "(`GOMP_SPINCOUNT=100`) as every engine's do unless `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT` is set "
    "(`common/cpu_budget.py`)")

PORT_RANGE = Variable(
    "PDSERVE_PORT_RANGE", "`LOW-HIGH`", "",
    "the ports launchers pick for the processes they start (`make serve`, the test suite's clusters); unset: "
    "10000 up to the kernel's ephemeral range. Concurrent launchers on one host given disjoint ranges never "
    "pick the same port (`deploy/processes.py`)")

VARIABLES: tuple[Variable, ...] = (CACHE_DIR, API_KEY, NODE_API_KEY, EVENT_LOOP, KERNELS, LINEAR, CPU_ISA,
                                   CONFIGURE_LOGGING, SHARED_CORES, PORT_RANGE)
_OFF = ("0", "false", "no", "off")


def value(var: Variable) -> str:
    """The variable as set (an empty value included), else its default."""
    return os.environ.get(var.name, var.default)


def optional(var: Variable) -> str | None:
    """The variable's value, None when unset or empty (an API key: none)."""
    return os.environ.get(var.name) or var.default or None


def flag(var: Variable) -> bool:
    """A boolean variable: false for 0, false, no or off (any case, spaces ignored), true otherwise."""
    return value(var).strip().lower() not in _OFF


def path(var: Variable) -> Path:
    """A directory variable as set; unset or empty: its default, `~` expanded."""
    return Path(os.environ.get(var.name) or Path(var.default).expanduser())


def markdown_table() -> str:
    """docs/configuration.md's table of these variables."""
    rows = ["| variable | type | default | effect |", "|---|---|---|---|"]
    rows += [f"| `{v.name}` | {v.kind} | {f'`{v.default}`' if v.default else 'unset'} | {v.doc} |" for v in VARIABLES]
    return "\n".join(rows)


if __name__ == "__main__":
    sys.stdout.write(markdown_table() + "\n")
