"""`python -m gradq.server` is `gradq serve`."""

import sys

from gradq.server.cli import main

sys.exit(main())
