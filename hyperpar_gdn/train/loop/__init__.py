"""The training loop, written once for every framework: :mod:`.trainer` (the :class:`Trainer`:
build, train, close), :mod:`.header` (the run's header line), :mod:`.log` (the rank-prefixed
logger), :mod:`.metrics` (records, step lines, ``--metrics-json``), :mod:`.parity`
(``--check-parity``), :mod:`.callbacks` (hooks into the loop), :mod:`.faults` (non-finite steps,
save errors, stuck ranks) and :mod:`.fault_injection` (the tests' callbacks: a NaN, a SIGKILL)."""
