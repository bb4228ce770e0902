"""`python -m recover_patches.collectives.coordinator`: the coordinator by hand."""
import sys

from recover_patches.collectives.coordinator.process import main

sys.exit(main())
