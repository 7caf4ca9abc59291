"""``python -m tiercache``: the same command line as the ``tiercache`` console script."""

from tiercache.cli import main

if __name__ == "__main__":
    main()
