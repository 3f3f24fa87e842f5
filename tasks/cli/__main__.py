"""`python -m tasks.cli ...` is `msllm ...`."""

import sys

from tasks.cli import main

sys.exit(main())
