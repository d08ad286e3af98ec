"""Time in tests: no pass or fail on a wall-clock figure tuned on one machine.

CI runs the suite on 2-core machines of several CPU kinds (the slowest about 2.5x slower than the
fastest) and sometimes beside a busy neighbour, so a test that holds the product to "within 10 s" fails a
correct change on another machine. Instead:

- something that must happen is polled for with HANG_S as the deadline: only a hang fails, and the
  message states the bound the product documents;
- a deadline the product documents must not fire early (that bound is exact: the test's clock starts
  before the product's) and must fire before whatever it has to be told apart from (the default it
  replaced, a longer deadline, the fault's own duration), not within a figure measured on one machine;
- a claim about speed compares with a reference measured in the same test on the same machine.
"""
from __future__ import annotations

HANG_S = 60.0  # what a user would call hung: ten times and more the few seconds the product promises here
