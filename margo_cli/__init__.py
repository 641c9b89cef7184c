"""The `margo` command line: argument parsing and output only; the work lives in packages."""
