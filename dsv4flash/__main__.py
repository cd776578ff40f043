"""`python -m dsv4flash` is the `dsv4flash` console script."""

import sys

from dsv4flash.cli import main

sys.exit(main())
