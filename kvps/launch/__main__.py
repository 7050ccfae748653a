"""`python -m kvps.launch`."""

import sys

from .cli import main

sys.exit(main())
