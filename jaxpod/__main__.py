"""`python -m jaxpod ARGS` is `jaxpod ARGS`."""

from jaxpod.cli import main

main()
