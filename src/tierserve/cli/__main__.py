"""``python -m tierserve.cli``: the console script (how ``tierserve up`` and the tests start roles)."""

import sys

from tierserve.cli.main import main

sys.exit(main())
