"""`coldsnap`: the command-line entry point."""
