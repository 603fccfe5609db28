"""Public ops: argument checks, then dispatch to a backend (see ``_registry``)."""
