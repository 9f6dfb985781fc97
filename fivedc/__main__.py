"""`python -m fivedc ...`: the `fivedc` command without its console script."""

import sys

from fivedc.cli.main import main

sys.exit(main())
