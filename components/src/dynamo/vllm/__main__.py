"""`python -m dynamo.vllm`: see `dynamo.vllm.main`.

The guard matters: vLLM starts its engine core in a spawned process, which re-imports the
main module; without it every spawn would start another worker.
"""

import sys

from dynamo.vllm.main import main

if __name__ == "__main__":
    sys.exit(main())
