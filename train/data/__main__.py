"""``python -m train.data prepare SRC... --out DIR``: see `train.data.prepare`."""

import sys

from train.data.prepare import main

if __name__ == "__main__":
    sys.exit(main())
