"""ml_collections experiment configs; each file's get_config() docstring holds its run command."""
