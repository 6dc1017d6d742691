"""``python -m dsched`` is the ``dsched`` command."""

import sys

from .cli import main

sys.exit(main())
