"""``python -m capturepass show DIR``."""

import sys

from capturepass.cli import main

sys.exit(main())
