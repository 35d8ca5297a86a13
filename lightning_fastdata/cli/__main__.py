"""``python -m lightning_fastdata.cli``: the ``lightning-fastdata`` console script."""

import sys

from lightning_fastdata.cli import main

sys.exit(main())
