#!/usr/bin/env python3
"""The chaos lab (tests/lab): hosts in network namespaces, real sshd, the console, a seeded fault schedule.

    sudo .venv/bin/python scripts/chaos.py --seed 7 --faults 50     # the soak (~15 min)
    sudo .venv/bin/python scripts/chaos.py --cleanup                # remove zbc* leftovers of a killed lab

docs/reliability.md says what is measured and holds the last soak's report.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the lab lives beside the test helpers it shares (sshd.py)

from lab.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
