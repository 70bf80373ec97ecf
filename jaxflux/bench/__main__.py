"""`python -m jaxflux.bench`: see the package docstring (jaxflux/bench/__init__.py)."""
import sys

from jaxflux.bench.cli import main

if __name__ == "__main__":
  sys.exit(main())
