"""``python -m kvtier ...``: the same entry point as the ``kvtier`` command."""
import sys

from kvtier.commands.cli import main

sys.exit(main())
