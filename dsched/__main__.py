"""``python -m dsched`` is the ``dsched`` command."""

import sys

from dsched.apps.cli import main

sys.exit(main())
