"""`python -m gradq.cli` is the `gradq` command."""

import sys

from gradq.cli import main

sys.exit(main())
