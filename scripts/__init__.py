"""Command-line entry points over the library, installed as ``tokenmaxx.scripts``: each script's ``main(argv)`` parses
its own dataclass. Run them as ``tokenmaxx <command> ...`` (``cli.py``) or as ``python scripts/<name>.py ...``."""
