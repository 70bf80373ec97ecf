import sys

from jaxflux.tune.cli import main

sys.exit(main())
