import sys

from coldsnap.cli.main import main

sys.exit(main())
