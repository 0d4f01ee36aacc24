"""``python -m elastic_runner`` is the ``elastic-runner`` command."""

import sys

from .cli import main

sys.exit(main())
