"""``python -m shardcache`` is the ``shardcache`` command."""

from ._cli.main import main

raise SystemExit(main())
