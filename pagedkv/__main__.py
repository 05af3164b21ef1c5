"""`python -m pagedkv ...` is the `pagedkv` command."""

import sys

from pagedkv.cli import main

sys.exit(main())
