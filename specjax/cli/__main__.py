"""`python -m specjax.cli`: the `specjax` command."""

import sys

from specjax.cli import main

sys.exit(main())
