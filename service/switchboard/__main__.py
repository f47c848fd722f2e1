"""``python -m switchboard``: the ``switchboard`` command, for an environment whose scripts are not on the PATH."""

import sys

from .cli.main import main

sys.exit(main())
