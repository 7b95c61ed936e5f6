"""Developer tools (code generation); not needed at run time."""
