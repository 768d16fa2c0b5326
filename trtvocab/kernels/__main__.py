"""``python -m trtvocab.kernels --build``: build (or find cached) and self-check the fused kernels."""

import sys

from trtvocab.kernels.cli import main

sys.exit(main())
