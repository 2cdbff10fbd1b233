"""svdq_aot: build-time side of svdq-aot (config -> variants -> compile -> artifacts -> manifest)."""

__version__ = "0.1.0"
