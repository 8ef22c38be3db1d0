"""`python -m dynamo.mocker`: see `dynamo.mocker.main`."""

import sys

from dynamo.mocker.main import main

if __name__ == "__main__":
    sys.exit(main())
