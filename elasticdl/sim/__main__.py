import sys

from elasticdl.sim.runner import main

sys.exit(main())
