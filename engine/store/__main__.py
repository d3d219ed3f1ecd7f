"""`python -m engine.store`: the TCP membership store (engine/store/server.py)."""

import sys

from engine.store.server import main

sys.exit(main())
