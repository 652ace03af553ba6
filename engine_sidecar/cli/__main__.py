"""`python -m engine_sidecar.cli`: the same as the `ragcache` command."""

import sys

from engine_sidecar.cli.main import main

sys.exit(main())
