import sys

from training.run.cli import main

sys.exit(main())
