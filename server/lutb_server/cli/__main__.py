"""``python -m lutb_server.cli``: the ``lutb`` command without its console script."""

import sys

from lutb_server.cli import main

sys.exit(main())
