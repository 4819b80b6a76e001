"""``python -m batchgen_data.rebalance.simulate SCENARIO.jsonl --actors N``."""
import sys

from batchgen_data.rebalance.simulate.cli import main

if __name__ == "__main__":
    sys.exit(main())
