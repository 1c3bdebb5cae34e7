import sys

from modelpar.cli import main

sys.exit(main())
