"""ds-estimate-memory from a checkout, uninstalled: python tools/ds_estimate_memory.py --params 7B"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload.cli.estimate_memory import main  # noqa: E402

sys.exit(main())
