"""``python -m atomtool``: the same command line as the ``atomtool`` console script (:mod:`atomtool.entry`)."""

from atomtool.entry import main

if __name__ == "__main__":
    main()
