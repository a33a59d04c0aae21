"""``python -m services`` is the ``rlfleet`` command (useful where the script is not on PATH)."""

import sys

from services.cli import main

sys.exit(main())
