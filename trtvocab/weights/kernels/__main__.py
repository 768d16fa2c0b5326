"""``python -m trtvocab.weights.kernels --build``: build (or find cached) and self-check the fused kernels."""

import sys

from trtvocab.weights.kernels import main

sys.exit(main())
