"""The benchmark, part of the package: ``fastkda-bench`` or ``python -m fastkda.bench`` (``--help``).

- :mod:`.workloads`: the shipped workloads file and the inputs made from it;
- :mod:`.runners`: fastkda and its peers (FLA, FlashKDA; optional imports) as ``run()`` callables;
- :mod:`.timing`: eager and CUDA-graph medians, the device's copy and matrix-product rates, per-kernel times;
- :mod:`.work`: the bytes and FLOPs of each fastkda kernel under a call's plan, and the kernel breakdown;
- :mod:`.report`: the results files (JSON, markdown, plot), merged across runs;
- :mod:`.arguments`: argument types and checks shared by the models, layer and parallel command lines;
- :mod:`.cli`: the command line and the run loop.
"""

from .cli import main

__all__ = ["main"]
