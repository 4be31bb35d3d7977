"""`python -m jaxpod.figures`: see `jaxpod.figures.build`."""

from jaxpod.figures.build import main

main()
