import sys

from batchgen_data.rebalance.simulate.cli import main

sys.exit(main())
