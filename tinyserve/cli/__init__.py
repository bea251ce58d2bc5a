"""The `tinyserve` command line."""
