import sys

from lowbit.cli import main

sys.exit(main())
