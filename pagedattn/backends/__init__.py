"""One module per backend; the registry imports them lazily by name."""
