"""Bad model file: calls sys.exit while being imported (e.g. an argparse script)."""

import sys

sys.exit(3)
