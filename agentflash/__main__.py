"""`python -m agentflash` == the `agentflash` console script."""

from .cli import main

raise SystemExit(main())
