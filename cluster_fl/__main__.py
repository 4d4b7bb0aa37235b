"""``python -m cluster_fl`` is the same as the ``cluster-fl`` console script."""

from cluster_fl.cli import main

raise SystemExit(main())
