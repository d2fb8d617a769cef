"""`python -m jupyter_gpushare ...` is the `gpushare` command."""

from .cli import main

if __name__ == "__main__":
    main()
