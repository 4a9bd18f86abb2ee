"""Built-in adapters, one module each, imported only when asked for."""
