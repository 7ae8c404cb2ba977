"""opmap: the operator layer of LLM inference."""
__version__ = "0.1.0"
