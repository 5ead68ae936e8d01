"""``python -m ops.loadgen``: see ``ops.loadgen.cli``."""

import sys

from ops.loadgen.cli import main

sys.exit(main())
