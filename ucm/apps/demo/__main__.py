"""`python -m ucm.apps.demo`: the demo of `make demo`."""
import sys

from ucm.apps.demo.run import main

if __name__ == "__main__":
    sys.exit(main())
