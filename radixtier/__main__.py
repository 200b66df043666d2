import sys

from radixtier.cli import main

sys.exit(main())
