"""Developer tools beside the package, by purpose: ``profiling/`` (compiled kernels and device counters),
``sweeps/`` (launch settings and exactness over many shapes), ``variants/`` (kernel variants timed and checked
against each other), and ``device_tests.sh`` (everything a GPU run needs, in one call). Each runs as
``python tools/<group>/<name>.py`` from the repository root; variants and sweeps change a launch plan
(``--set``, :mod:`tools.plan_changes`), never fastkda's modules."""
