"""Run ds-nvme-bench from a source checkout: python tools/ds_nvme_bench.py --path DIR ..."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from offload.cli.nvme_bench import main  # noqa: E402

sys.exit(main())
