"""python -m tunepilot: the same as the `tunepilot` console script."""

from tunepilot.cli import console_main

console_main()
