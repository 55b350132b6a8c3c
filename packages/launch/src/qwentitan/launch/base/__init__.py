"""Layer base: errors, the environment variables that default config fields, one Target per
machine kind and the placement on it. Imported by every other layer; imports only itself."""
