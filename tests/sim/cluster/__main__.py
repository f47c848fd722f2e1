import sys

from .schedules import main

sys.exit(main())
