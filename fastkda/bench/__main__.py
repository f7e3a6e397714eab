"""``python -m fastkda.bench``: the benchmark's command line (:mod:`fastkda.bench.cli`)."""

import sys

from .cli import main

sys.exit(main())
