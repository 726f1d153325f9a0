"""``python -m helpers.cluster ...``: the torchrun entry point, :func:`helpers.cluster.entry.main`."""

from helpers.cluster.entry import main

if __name__ == "__main__":
    main()
