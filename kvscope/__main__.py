"""`python -m kvscope`: the `kvscope` command."""

import sys

from kvscope.app import main

if __name__ == "__main__":
    sys.exit(main())
