"""``python -m launch`` is the ``rlfleet`` command (useful where the script is not on PATH)."""

import sys

from launch.cli import main

sys.exit(main())
