"""`python -m console PROFILE ...` is `zeroband-console PROFILE ...`."""

import sys

from console.cli import main

sys.exit(main())
