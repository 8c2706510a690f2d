"""The research system's import paths (``tokenrouter.entrypoints.engine``)."""
