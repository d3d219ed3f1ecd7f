"""`python -m engine.data prepare SOURCE... --out DIR` and `python -m engine.data verify DIR` (see prepare.py)."""

import os
import sys

from engine.data.prepare import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)  # after a lost worker the executor's threads may never finish: nothing may wait for them at exit
