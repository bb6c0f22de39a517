"""`python -m zero.demo`, the demo's old name: runs `python -m zero.examples.demo` with the same arguments."""

import sys

from zero.examples.demo import main

if __name__ == "__main__":
    sys.exit(main())
