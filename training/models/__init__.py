"""Model families (training/models/registry.py) and the networks of the built-in ones."""
