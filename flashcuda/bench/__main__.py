"""`python -m flashcuda.bench [args]` = `flashcuda bench [args]` (works from a source tree)."""

import sys

from . import main

sys.exit(main(sys.argv[1:]))
