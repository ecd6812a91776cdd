"""`python -m tandem` is the same as the `tandem` console script."""

from tandem.cli.main import entry

if __name__ == "__main__":
    entry()
