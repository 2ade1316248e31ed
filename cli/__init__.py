"""The `deltalens` command line (installed as `deltalens.cli`): thin typer commands over the library."""
