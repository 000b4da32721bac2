"""``python -m carpool`` runs the command line."""

import sys

from carpool.cli import main

sys.exit(main())
