"""``python -m tokenrouter …`` runs the ``tokenrouter`` command line."""

from .cli import main

main()
