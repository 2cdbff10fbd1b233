"""Version of the runtime loader; the manifest reader compares it with the builder's."""

__version__ = "0.1.0"
