"""``python -m capturepass show DIR``."""

import sys

from capturepass.show.cli import main

sys.exit(main())
